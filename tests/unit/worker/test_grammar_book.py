"""A worker's grammars (runtime.speculation.grammar.book) over a batch: the masks it sends
to the device are each row's window masks (xgrammar's and llguidance's alike; rows without a
grammar allow everything), packed on the host and unpacked on the device; tokens reach the
matchers through a host copy; advancing and rewinding leave the windows as they were."""

from __future__ import annotations

import pytest
import torch

from runtime.models.runners.hostcopy import HostCopy
from runtime.speculation.grammar.book import GrammarBook
from runtime.speculation.grammar.window import (
    GrammarCompiler,
    GrammarWindow,
    parse_structured_outputs,
)
from tests.checkpoints import smollm2_tokenizer

XGRAMMAR = {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}
LLGUIDANCE = {"json": {"type": "string", "maxLength": 3}}  # lengths: llguidance


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def book(tok):
    with GrammarCompiler(tok, len(tok), [tok.eos_token_id]) as compiler:
        grammars = [compiler.compile(parse_structured_outputs(s)) for s in (XGRAMMAR, LLGUIDANCE)]
    book = GrammarBook(torch.device("cpu"))
    book.windows = {1: GrammarWindow(grammars[0]), 3: GrammarWindow(grammars[1])}
    return book


def test_window_and_step_masks_are_each_rows_own(book, tok):
    slots = [1, 2, 3]  # slot 2: no grammar
    proposals = [
        tok.encode(t, add_special_tokens=False)[:2] for t in ('{"a": 1', "hello world", '"abc"')
    ]
    masks = book.window_masks(slots, book.to_host(slots, torch.tensor(proposals)))
    assert masks is not None and masks.shape == (3, 3, len(tok)) and masks.dtype == torch.bool
    assert torch.equal(masks[0], book.windows[1].masks(proposals[0]))
    assert masks[1].all()
    assert torch.equal(masks[2], book.windows[3].masks(proposals[2]))
    step = book.step_masks(slots)
    assert step is not None and torch.equal(step[:, 0], masks[:, 0])
    assert book.step_masks([2]) is None and book.to_host([2], torch.tensor([5])) is None


def test_advance_through_a_host_copy_and_rewind(book, tok):
    first = [tok.encode('{"', add_special_tokens=False)[0], 0, tok.encode('"')[0]]
    before = book.step_masks([1, 2, 3])
    book.advance([1, 2, 3], HostCopy(torch.tensor(first)))
    assert [book.windows[s].pending for s in (1, 3)] == [1, 1]
    after = book.step_masks([1, 2, 3])
    assert after is not None and not torch.equal(after, before)
    book.rewind([1, 2, 3])
    assert torch.equal(book.step_masks([1, 2, 3]), before)
