import msgpack
import pytest

from runtime.control import commands, protocol

pytestmark = pytest.mark.timeout(30)


def test_round_trip():
    msg = {"type": "round", "step": 3, "slots": [0, 2], "k": 4}
    assert protocol.decode(protocol.encode(msg)) == msg


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        msgpack.packb([1, 2, 3]),  # not a map
        msgpack.packb({"type": "nope"}),  # unknown type
        msgpack.packb({"type": "round", "step": 1, "slots": []}),  # missing field
        msgpack.packb({"type": "round", "step": "1", "slots": [], "k": 1}),  # wrong type
        msgpack.packb({"type": "round", "step": True, "slots": [], "k": 1}),  # bool is no int
        msgpack.packb({"type": "shutdown", "extra": 1}),  # unknown field
        msgpack.packb({1: 2}),  # non-string key
        msgpack.packb(msgpack.ExtType(1, b"x")),  # extension type
        b"\x80\x03cbuiltins\nexec\n.",  # a pickle
    ],
)
def test_bad_frames_are_protocol_errors(frame):
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(frame)


def test_deep_nesting_refused():
    value = []
    for _ in range(50):
        value = [value]
    frame = msgpack.packb({"type": "init", "config": {"x": value}})
    with pytest.raises(protocol.ProtocolError, match="nested"):
        protocol.decode(frame)


def test_huge_declared_length_refused():
    frame = b"\xdb\xff\xff\xff\xff" + b"x" * 10  # str32 claiming 4 GiB
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(frame)


def test_int_list():
    assert protocol.int_list([1, 2], "x") == [1, 2]
    for bad in ([1, True], "12", [1.0]):
        with pytest.raises(protocol.ProtocolError, match="x"):
            protocol.int_list(bad, "x")


def test_check_sampling_guards_prefill_params():
    ok = {"temperature": 0.7, "top_k": None, "top_p": 0.9, "seed": 3}
    assert commands.check_sampling(ok) == {"temperature": 0.7, "top_k": 0, "top_p": 0.9, "seed": 3}
    for bad, match in (
        ([1], "expected maps"),
        ({"temperature": 1.0}, "prefill.params"),
        (dict(ok, top_p=0.0), "out of range"),
        (dict(ok, temperature=-1), "out of range"),
    ):
        with pytest.raises(protocol.ProtocolError, match=match):
            commands.check_sampling(bad)
