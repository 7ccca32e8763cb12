import pytest

from runtime.serving.textstream import TextStream

pytestmark = pytest.mark.timeout(30)


class ByteTokenizer:
    """Each token is one UTF-8 byte; incomplete characters decode to U+FFFD."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def ids(text):
    return list(text.encode())


def test_multibyte_character_split_across_tokens():
    stream = TextStream(ByteTokenizer())
    euro = ids("€")  # three bytes
    stream.add(ids("a") + euro[:1])
    assert stream.delta(final=False) == "a"
    stream.add(euro[1:2])
    assert stream.delta(final=False) == ""
    stream.add(euro[2:] + ids("b"))
    assert stream.delta(final=False) == "€b"


def test_stop_string_truncates_text_and_tokens():
    stream = TextStream(ByteTokenizer(), stop=("STOP",))
    kept, stopped = stream.add(ids("hello ST"))
    assert not stopped and kept == ids("hello ST")
    assert stream.delta(final=False) == "hello "  # "ST" held back: may start STOP
    kept, stopped = stream.add(ids("OP and more"))
    assert stopped and kept == ids("OP")
    assert stream.text == "hello "
    assert stream.delta(final=True) == ""


def test_held_text_released_when_no_stop():
    stream = TextStream(ByteTokenizer(), stop=("STOP",))
    stream.add(ids("a S"))
    assert stream.delta(final=False) == "a "
    stream.add(ids("x"))
    assert stream.delta(final=False) == "Sx"


def test_deltas_concatenate_to_text():
    stream = TextStream(ByteTokenizer(), stop=("zz",))
    pieces = []
    for chunk in ["ab", "c€"[:1], "€", "dz", "y", "q"]:
        stream.add(ids(chunk))
        pieces.append(stream.delta(final=False))
    pieces.append(stream.delta(final=True))
    assert "".join(pieces) == stream.text == "abc€dzyq"
