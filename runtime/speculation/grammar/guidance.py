"""llguidance behind xgrammar's interface, for the JSON schemas xgrammar does not enforce
(runtime.speculation.grammar.route): a GuidanceGrammar stands where an xgrammar
CompiledGrammar does, and a GuidanceMatcher does what GrammarWindow asks of xgrammar's
GrammarMatcher (accept_token, rollback, fill_next_token_bitmask, is_terminated, is_completed).

- The vocabulary is xgrammar's TokenizerInfo, which every worker already has: its decoded
  token bytes (exactly the tokenizer's) and its stop ids. xgrammar's special tokens (empty
  text) and the stop tokens are special to llguidance too: never text.
- Stop tokens are this module's: a mask allows them when the grammar is complete, and taking
  one terminates the matcher (rolled back like any token), as xgrammar's matcher does.
- JSON comes in xgrammar's layout (", " and ": ", no other whitespace).
- Bounds: rank 0 validates a schema and times its first masks in the compile child
  (runtime.speculation.grammar.child: 5 s, 2 GiB), as for xgrammar. Every matcher runs under
  LIMITS: at most 50,000 lexer states (about 100 MB), 1,000,000 fuel to build the lexer
  (about 20 ms), per mask 200,000 lexer fuel (about 15 ms) and 50,000 Earley items (about
  3 ms), grammars of at most 500,000 symbols. A matcher past a limit, or in any other error,
  raises GuidanceError with llguidance's reason, never a wrong mask (on a worker that is the
  rank's error: runtime.worker.dispatch reports it to rank 0, which fails the clients).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
import torch

from runtime.speculation.grammar.route import ENFORCED, GUIDANCE_JSON_OPTIONS, guidance_reasons

LIMITS: dict[str, Any] = {
    "max_items_in_row": 2000,
    "initial_lexer_fuel": 1_000_000,
    "step_lexer_fuel": 200_000,
    "step_max_items": 50_000,
    "max_lexer_states": 50_000,
    "max_grammar_size": 500_000,
}
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[.*?\])")


class GuidanceError(RuntimeError):
    """llguidance's matcher failed (a limit, or an internal error)."""


def limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS, verbose_errors=False)


@dataclass(frozen=True, eq=False)
class GuidanceGrammar:
    """A schema's llguidance grammar for one vocabulary: what GrammarWindow matches."""

    tokenizer: Any  # llguidance.LLTokenizer (guidance_tokenizer)
    grammar: str  # llguidance's grammar JSON
    vocab_size: int
    stop_token_ids: tuple[int, ...]


class _Vocabulary:
    """llguidance.TokenizerWrapper's source: token bytes, specials, and a tokenize callback
    (llguidance's own greedy tokenization of this vocabulary: the same on every worker)."""

    def __init__(self, tokens: list[bytes], special: list[int]):
        self.tokens, self.special_token_ids = tokens, special
        self.eos_token_id, self.bos_token_id = special[0], None
        self.greedy: Any = None

    def __call__(self, text: Any) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text only")  # TokenizerWrapper then passes str
        return [] if self.greedy is None else list(self.greedy(text))


def guidance_tokenizer(info: Any) -> Any:
    """An llguidance.LLTokenizer from xgrammar's TokenizerInfo (rank 0's, or the one a worker
    deserialized): the same token bytes, stop ids and vocabulary width (about 0.1 s)."""
    size, stops = int(info.vocab_size), [int(t) for t in info.stop_token_ids]
    decoded = list(info.decoded_vocab)[:size]
    tokens = [bytes(t) for t in decoded] + [b""] * (size - len(decoded))
    special = sorted({*stops, *(int(t) for t in info.special_token_ids if t < size)})
    for token in special:
        tokens[token] = b""
    vocabulary = _Vocabulary(tokens, special)
    wrapper = llguidance.TokenizerWrapper(vocabulary)
    tokenizer = llguidance.LLTokenizer(wrapper, n_vocab=size, eos_token=stops)
    vocabulary.greedy = tokenizer.greedy_tokenize
    return tokenizer


def guidance_grammar(tokenizer: Any, schema: str, stop_token_ids: Sequence[int]) -> GuidanceGrammar:
    """A JSON schema's grammar (not validated: validate() on rank 0 did that)."""
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=GUIDANCE_JSON_OPTIONS)
    stops = tuple(int(t) for t in stop_token_ids)
    return GuidanceGrammar(tokenizer, grammar, int(tokenizer.vocab_size), stops)


def lark_grammar(tokenizer: Any, lark: str, stop_token_ids: Sequence[int]) -> GuidanceGrammar:
    """A Lark grammar's (a "lark" spec: a forced tool call; its %json schemas carry
    GUIDANCE_JSON_OPTIONS as "x-guidance"), not validated."""
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    stops = tuple(int(t) for t in stop_token_ids)
    return GuidanceGrammar(tokenizer, grammar, int(tokenizer.vocab_size), stops)


def validate(tokenizer: Any, schema: str, stop_token_ids: Sequence[int]) -> GuidanceGrammar | str:
    """The grammar of `schema`, or why llguidance refuses it (a message for the user)."""
    compiled = guidance_grammar(tokenizer, schema, stop_token_ids)
    error = llguidance.LLMatcher.validate_grammar(compiled.grammar, tokenizer, limits=limits())
    return refusal(schema, error) if error else compiled


def validate_lark(
    tokenizer: Any, lark: str, stop_token_ids: Sequence[int]
) -> GuidanceGrammar | str:
    """The grammar of a Lark text, or why llguidance refuses it (its first line)."""
    compiled = lark_grammar(tokenizer, lark, stop_token_ids)
    error = llguidance.LLMatcher.validate_grammar(compiled.grammar, tokenizer, limits=limits())
    return lark_refusal(error) if error else compiled


def lark_refusal(error: str) -> str:
    """llguidance's reason for refusing a Lark grammar, without the grammar's text it quotes."""
    first = (error.strip().splitlines() or ["(no message)"])[0]
    return "llguidance refuses the grammar: " + re.sub(r"^at \d+\(\d+\): ", "", first)


def refusal(schema: str, error: str) -> str:
    """llguidance's reason, told as which backend does not enforce what."""
    reasons = guidance_reasons(json.loads(schema))
    found = _UNIMPLEMENTED.search(error)
    if found is None:
        return (
            f"the schema needs llguidance (xgrammar does not enforce {_names(reasons)}), "
            f"which refuses it: {error.strip()}"
        )
    keys = [str(k) for k in json.loads(found.group(1))]
    neither = [k for k in keys if k in reasons or k not in ENFORCED]
    xgrammar_only = [k for k in keys if k not in neither]
    parts = []
    if neither:
        parts.append(f"the schema uses {_names(neither)}, which neither xgrammar nor llguidance")
        parts[-1] += " enforces"
    if xgrammar_only:
        parts.append(
            f"the schema uses {_names(xgrammar_only)}, which llguidance does not enforce, with "
            f"{_names(reasons)}, which xgrammar does not enforce"
        )
    return "; ".join(parts)


def _names(keys: Sequence[str]) -> str:
    return ", ".join(k if " " in k else f"'{k}'" for k in keys)


class GuidanceMatcher:
    """xgrammar GrammarMatcher's part that GrammarWindow uses, over an llguidance LLMatcher;
    the stop tokens (`override_stop_tokens`, default the grammar's) handled here."""

    def __init__(self, compiled: GuidanceGrammar, override_stop_tokens: Sequence[int] | None):
        self._matcher = llguidance.LLMatcher(
            compiled.tokenizer, compiled.grammar, log_level=0, limits=limits()
        )
        self._check()
        self.vocab_size = compiled.vocab_size
        stops = override_stop_tokens or compiled.stop_token_ids
        self.stop_token_ids = sorted({int(t) for t in stops if 0 <= t < self.vocab_size})
        self._theirs = [int(t) for t in compiled.tokenizer.eos_tokens if t < self.vocab_size]
        self._terminated = False

    def is_terminated(self) -> bool:
        return self._terminated

    def is_completed(self) -> bool:
        return self._terminated or self._matcher.is_accepting()

    def accept_token(self, token: int) -> bool:
        """Take `token` if the grammar allows it (False, nothing changed, if not)."""
        if self._terminated:
            return False
        if token in self.stop_token_ids:
            self._terminated = self._matcher.is_accepting()
            return self._terminated
        if token in self._theirs or self._matcher.validate_tokens([token]) != 1:
            return False
        if not self._matcher.consume_token(token):
            self._check()
            raise GuidanceError(f"llguidance's matcher refused token {token} it allowed")
        return True

    def rollback(self, n: int) -> None:
        if n and self._terminated:
            self._terminated, n = False, n - 1
        if n and not self._matcher.rollback(n):
            self._check()
            raise GuidanceError(f"llguidance's matcher could not roll back {n} tokens")

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> None:
        """Row `index` of an int32 [B, ceil(V / 32)] CPU bitmask: the allowed tokens."""
        if self._terminated:
            bitmask[index] = 0
            return
        row = bitmask[index]  # llguidance.torch.fill_next_token_bitmask without its import
        assert row.dtype == torch.int32 and row.is_cpu and row.is_contiguous()
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        self._check()
        words = row.numpy().view(np.uint32)
        for token in self._theirs:
            words[token >> 5] &= np.uint32(0xFFFFFFFF ^ (1 << (token & 31)))
        if self._matcher.is_accepting():
            for token in self.stop_token_ids:
                words[token >> 5] |= np.uint32(1 << (token & 31))

    def _check(self) -> None:
        if self._matcher.is_error():
            error = self._matcher.get_error().strip().splitlines() or ["(no message)"]
            raise GuidanceError(f"llguidance's matcher failed: {error[0]}")
