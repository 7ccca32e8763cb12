"""runtime.speculation.retokenize: token ids across a word-level target tokenizer and a
character-level draft tokenizer over one alphabet (tests.tiny_tokenizers)."""

from __future__ import annotations

import pytest

from runtime.speculation.retokenize import TextBridge, common_prefix, keep_length
from tests.tiny_tokenizers import save_text_tokenizer


@pytest.fixture(scope="module")
def bridge(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("texttok")
    words = AutoTokenizer.from_pretrained(save_text_tokenizer(root / "w", "abc", words=True))
    chars = AutoTokenizer.from_pretrained(save_text_tokenizer(root / "c", "abc", words=False))
    return TextBridge(words, chars)


def w(bridge, text: str) -> list[int]:
    return bridge.target.encode(text, add_special_tokens=False)


def c(bridge, text: str) -> list[int]:
    return bridge.draft.encode(text, add_special_tokens=False)


def test_draft_history_is_the_committed_text(bridge):
    assert bridge.draft_history(w(bridge, "ab c ba")) == c(bridge, "ab c ba")
    assert bridge.draft_history([]) == []


def test_a_proposal_becomes_fewer_target_tokens(bridge):
    """Five characters " ca b" after "ab c": two words."""
    committed = w(bridge, "ab c")
    assert bridge.to_target(committed, c(bridge, "ab c"), c(bridge, " ca b")) == w(bridge, "ca b")


def test_a_proposal_becomes_more_target_tokens(bridge):
    """Characters and words of one letter: " a b c" is six characters, three words; a
    proposal of two characters " a" one word."""
    committed = w(bridge, "ab")
    assert bridge.to_target(committed, c(bridge, "ab"), c(bridge, " a b c")) == w(bridge, "a b c")
    assert bridge.to_target(committed, c(bridge, "ab"), c(bridge, " a")) == w(bridge, "a")


def test_boundary_merge_proposes_nothing(bridge):
    """ "a" committed, the draft continues the word ("a" + "b c" = "ab c"): the target's
    committed "a" would be re-split, so nothing is proposed; starting with a space it is."""
    committed = w(bridge, "a")
    assert bridge.to_target(committed, c(bridge, "a"), c(bridge, "b c")) == []
    assert bridge.to_target(committed, c(bridge, "a"), c(bridge, " b c")) == w(bridge, "b c")


def test_empty_mapping(bridge):
    """No proposals, or only spaces (no new word), or ids past the draft's tokenizer."""
    committed = w(bridge, "ab c")
    assert bridge.to_target(committed, c(bridge, "ab c"), []) == []
    assert bridge.to_target(committed, c(bridge, "ab c"), c(bridge, "  ")) == []
    assert bridge.to_target(committed, c(bridge, "ab c"), [99, 1]) == []


def test_the_window_of_context(bridge):
    """Only the last tokens give the context: a long committed sequence maps the same."""
    long = "a b c " * 10 + "ab"
    assert bridge.to_target(w(bridge, long), c(bridge, long), c(bridge, " ba")) == w(bridge, "ba")


def test_keep_length():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert keep_length([1, 2, 3, 4], [1, 2, 3, 4, 5]) == 3  # the last stays to be fed
    assert keep_length([1, 2, 9], [1, 2, 3, 4]) == 2
    assert keep_length([5, 6], [1, 2]) == 0
