"""Structured outputs for speculation: one request's grammar state on the side that samples,
its token masks over a verify window (applied to a batch's scores by the logits processors:
runtime.speculation.processors).

The mask comes after the penalties and before temperature, min-p, top-k and top-p
(runtime.speculation.processors), at every sampled position alike: the draft's, each of its
proposals masked after the ones before it, and each verify position i masked after the
committed tokens and proposals[:i]. After a round, the window commits what was accepted.

The parts: grammar.spec (what a request asks for, parsed and bounded), grammar.route (which
backend: xgrammar, or llguidance for the JSON schemas xgrammar would not enforce),
grammar.compiler (the orchestrator's bounded compile in a child process, grammar.child),
grammar.load (the workers' side: the tokenizer's view, the wire form, rebuilding a compiled
grammar), grammar.guidance (llguidance behind xgrammar's matcher interface), and this module.

Cost per masked position with SmolLM2's 49,152-token vocabulary: filling xgrammar's bitmask
about 10 us for a JSON schema, unpacking it to bools about 20 us.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr

from runtime.speculation.grammar.child import to_wire
from runtime.speculation.grammar.compiler import GrammarCompiler
from runtime.speculation.grammar.guidance import GuidanceGrammar, GuidanceMatcher
from runtime.speculation.grammar.load import (
    GrammarLoader,
    Prepared,
    from_wire,
    tokenizer_info,
)
from runtime.speculation.grammar.spec import (
    GrammarSpec,
    parse_structured_outputs,
)

__all__ = [
    "GrammarCompiler",
    "GrammarLoader",
    "GrammarSpec",
    "GrammarWindow",
    "from_wire",
    "parse_structured_outputs",
    "Prepared",
    "to_wire",
    "tokenizer_info",
    "unpack_bitmask",
]

ALL_ALLOWED = -1  # a bitmask word with every bit set


class GrammarWindow:
    """One request's grammar matcher: the committed tokens, plus tokens advanced over
    speculatively (rolled back before the next commit).

    A position's mask is True where the grammar allows the token. Where the mask is not the
    grammar's, it is all True: after a token the grammar did not take (a rejected proposal,
    so the target never uses that position: under `tokens` acceptance it samples position j
    from position j's own mask and discards everything after a proposal it rejects) and after
    the grammar's end (a stop token was taken; the request ends there). All True keeps those
    positions' scores finite, where all False would make their softmax NaN.

    When the grammar is complete, its mask allows the stop tokens (the model's EOS ids, from
    runtime.speculation.grammar.compiler.tokenizer_info, or `stop_token_ids` here).

    A matcher that fails (llguidance past one of its limits: grammar.guidance.GuidanceError)
    leaves the window `failure` (its reason) for good: every mask from then on allows only
    the stop tokens, so the request ends at once, and the worker reports why
    (runtime.speculation.grammar.book); the tokens before stay the grammar's."""

    def __init__(self, compiled: Any, stop_token_ids: Sequence[int] | None = None):
        """`compiled`: xgrammar's CompiledGrammar or llguidance's GuidanceGrammar (a JSON
        schema xgrammar would not enforce: runtime.speculation.grammar.route)."""
        stops = [int(t) for t in stop_token_ids] if stop_token_ids else None
        self._matcher: Any
        if isinstance(compiled, GuidanceGrammar):
            self._matcher = GuidanceMatcher(compiled, stops)
            self.vocab_size: int = compiled.vocab_size
        else:
            self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops)
            self.vocab_size = compiled.tokenizer_info.vocab_size
        self._words = (self.vocab_size + 31) // 32
        self._pending = 0  # tokens advanced over since the committed state
        self._taken = 0  # of them, the first ones the grammar took (the rest: off grammar)
        self.slowest_mask_s = 0.0  # the longest one mask took (grammar.compiler.PROBE_MASK_S)
        self.failure: str | None = None  # why the matcher failed, once it did
        self._stops = [int(t) for t in self._matcher.stop_token_ids if 0 <= t < self.vocab_size]

    @property
    def pending(self) -> int:
        """Tokens advanced over and not rolled back."""
        return self._pending

    @property
    def is_terminated(self) -> bool:
        """A stop token was taken (among the committed tokens or those advanced over), or the
        matcher failed."""
        return self.failure is not None or self._matcher.is_terminated()

    @property
    def is_complete(self) -> bool:
        """The tokens taken so far form a whole match: a stop token may come next (or came)."""
        return self._matcher.is_completed()

    def next_mask(self) -> torch.Tensor:
        """bool [V]: the tokens allowed at the current position (a draft step)."""
        packed = torch.empty(1, self._words, dtype=torch.int32)
        self._fill(packed, 0)
        return unpack_bitmask(packed, self.vocab_size)[0]

    def advance(self, token: int) -> bool:
        """Move past `token` (a draft proposal). False when the grammar does not take it (or
        ended): from then on, masks are all True until rolled back past it."""
        self._pending += 1
        if self._pending - 1 != self._taken or self.is_terminated:
            return False
        if not 0 <= token < self.vocab_size or not self._guarded(self._matcher.accept_token, token):
            return False
        self._taken += 1
        return True

    def rollback(self, n: int) -> None:
        """Undo the last n advances."""
        if not 0 <= n <= self._pending:
            raise ValueError(f"rollback of {n} tokens, {self._pending} advanced")
        off_grammar = self._pending - self._taken
        taken_back = n - min(n, off_grammar)
        if taken_back and self.failure is None:
            self._guarded(self._matcher.rollback, taken_back)
        self._taken -= taken_back
        self._pending -= n

    def masks(self, proposals: Sequence[int]) -> torch.Tensor:
        """bool [len(proposals) + 1, V]: position i's mask after the committed tokens and
        proposals[:i] (see the class for the positions after one the grammar did not take).
        The window is left as it was."""
        return unpack_bitmask(self.packed_masks(proposals), self.vocab_size)

    def packed_masks(self, proposals: Sequence[int]) -> torch.Tensor:
        """masks() as xgrammar's int32 bitmask [len(proposals) + 1, ceil(V / 32)] on the CPU
        (32 times smaller to move to a device; unpack_bitmask there)."""
        packed = torch.empty(len(proposals) + 1, self._words, dtype=torch.int32)
        start = self._pending
        try:
            for i, token in enumerate(proposals):
                self._fill(packed, i)
                self.advance(token)
            self._fill(packed, len(proposals))
        finally:
            self.rollback(self._pending - start)
        return packed

    def commit(self, tokens: Sequence[int]) -> None:
        """Take the tokens a round committed (chosen under this window's masks, so allowed);
        ValueError, the window unchanged, when the grammar does not take one."""
        if self._pending:
            raise RuntimeError(f"commit with {self._pending} advanced tokens not rolled back")
        for i, token in enumerate(tokens):
            if not self.advance(token) and self.failure is None:
                self.rollback(self._pending)
                raise ValueError(
                    f"token {token} (the {i + 1}. of {len(tokens)} committed) is not allowed "
                    "by the grammar"
                )
        self._pending = self._taken = 0

    def _fill(self, packed: torch.Tensor, row: int) -> None:
        if self.failure is None and (self._pending != self._taken or self.is_terminated):
            packed[row] = ALL_ALLOWED
            return
        start = time.perf_counter()
        if self.failure is None:
            self._guarded(self._matcher.fill_next_token_bitmask, packed, row)
        if self.failure is not None:  # only the stop tokens: the request ends here
            packed[row] = 0 if self._stops else ALL_ALLOWED
            for token in self._stops:
                packed[row, token >> 5] |= _bit(token & 31)
        self.slowest_mask_s = max(self.slowest_mask_s, time.perf_counter() - start)

    def _guarded(self, call, *args) -> Any:
        """A matcher call; a failure of the matcher (RuntimeError: llguidance past a limit,
        an internal error) makes the window failed instead of raising."""
        try:
            return call(*args)
        except RuntimeError as e:
            self.failure = str(e) or type(e).__name__
            return False


def _bit(j: int) -> int:
    """Bit j of an int32 word, as a (signed) int32 value."""
    return -(1 << 31) if j == 31 else 1 << j


def unpack_bitmask(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's int32 bitmask [..., ceil(V / 32)] (bit j of word w: token 32 w + j) ->
    bool [..., vocab_size], on packed's device; vectorized."""
    shifts = torch.arange(32, dtype=torch.int32, device=packed.device)
    bits = (packed[..., None] >> shifts) & 1  # [..., W, 32]
    return bits.to(torch.bool).flatten(-2)[..., :vocab_size]
