"""The worker's side of compiled grammars: xgrammar's view of the tokenizer, and a cache that
turns what the orchestrator sends (runtime.speculation.grammar.compiler.Prepared) into an
xgrammar CompiledGrammar.

xgrammar 0.2.9's CompiledGrammar serializes (serialize_json / deserialize_json), but its JSON
holds a copy of the grammar's whole FSM for every rule, so it grows with rules x FSM: 80 KB
for a typical schema (19 KB zlib'd, 4 ms to write, 9 ms to read), 22 MB for an object of 256
optional properties (0.9 s to write, 0.5 s to read; compiling it takes 0.08 s), 1 GB for 2000
required properties. So a grammar travels compiled only when compiling it took longer than
LOCAL_COMPILE_S (e.g. the regex ".{1,1000}": 1.2 s to compile, 3.5 MB zlib'd, 0.19 s to read)
and its wire form is not too large (grammar.compiler.MAX_WIRE_BYTES); otherwise each worker
compiles the spec again, as fast as the orchestrator's child did (a grammar that took over
WORKER_COMPILE_S and does not travel is refused).
"""

from __future__ import annotations

import threading
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from runtime.errors import ArgumentError
from runtime.speculation.grammar.child import compile_job
from runtime.speculation.grammar.route import uses_guidance
from runtime.speculation.grammar.spec import GrammarSpec, choice_ebnf

LOCAL_COMPILE_S = 0.1  # a grammar that compiled faster travels as its spec, not compiled
WORKER_COMPILE_S = 1.0  # the longest compile a worker may redo (when the wire form is too large)
CACHE_SIZE = 64  # compiled grammars kept by spec
COMPILE_THREADS = 2  # xgrammar's threads for one compile
# JSON in one layout: separators ", " and ": ", no other whitespace. Any whitespace
# (xgrammar's and vLLM's default) lets a weak model loop on it; capping it (max_whitespace_cnt
# 16) makes a typical schema's grammar 2 MB (1 MB on the wire) instead of 42 KB (18 KB); and
# one layout leaves the draft and the target one less thing to disagree on.
JSON_OPTIONS: dict[str, Any] = {"any_whitespace": False}
ANY_JSON_OBJECT = '{"type":"object"}'


@dataclass(frozen=True)
class Prepared:
    """A spec that compiles within the bounds, as the orchestrator sends it to the workers:
    `wire` (to_wire's bytes) when compiling it took long, else None (compile it again)."""

    spec: GrammarSpec
    wire: bytes | None = None


def tokenizer_info(
    tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] | None = None
) -> xgr.TokenizerInfo:
    """xgrammar's view of a transformers tokenizer for logits `vocab_size` wide (ids past the
    tokenizer are never allowed). Stop tokens (the model's EOS ids; default the tokenizer's)
    are what a complete grammar allows. Other special tokens are never allowed: detokenising
    drops them, so a grammar that counted them as text would match text the user never sees."""
    if stop_token_ids:
        stops = sorted({int(t) for t in stop_token_ids})
    elif getattr(tokenizer, "eos_token_id", None) is not None:
        stops = [int(tokenizer.eos_token_id)]
    else:
        raise ValueError("the grammar needs stop token ids: the tokenizer has no EOS token")
    base = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stops
    )
    special = _special_ids(tokenizer) - set(stops)
    if not special or not hasattr(tokenizer, "backend_tokenizer"):
        return base  # a slow or tiktoken tokenizer: xgrammar's reading as it is
    encoded = [""] * vocab_size  # "" is special to xgrammar: never allowed
    for token, index in tokenizer.get_vocab().items():
        if index < vocab_size and index not in special:
            encoded[index] = token
    return xgr.TokenizerInfo(
        encoded,
        vocab_type=base.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=stops,
        add_prefix_space=base.add_prefix_space,
    )


def _special_ids(tokenizer: Any) -> set[int]:
    ids = {int(t) for t in getattr(tokenizer, "all_special_ids", [])}
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return ids | {int(i) for i, t in added.items() if getattr(t, "special", False)}


def from_wire(data: bytes, info: xgr.TokenizerInfo) -> xgr.CompiledGrammar:
    """A compiled grammar from `to_wire`'s bytes (runtime.speculation.grammar.child); `info`
    must be built like the sender's (same tokenizer, vocab size and stop ids), else
    ValueError."""
    try:
        return xgr.CompiledGrammar.deserialize_json(zlib.decompress(data).decode(), info)
    except (zlib.error, UnicodeDecodeError, RuntimeError, ValueError) as e:
        words = f"structured_outputs: a compiled grammar that does not load: {e}"
        raise ArgumentError(words, "structured_outputs") from e


def job_of(spec: GrammarSpec) -> list[str]:
    """[method, source]: what to ask xgrammar's compiler for (grammar.child.compile_job), or
    ["guidance", schema] for a JSON schema llguidance enforces (grammar.route), or ["lark",
    grammar] for llguidance's Lark (a forced tool call)."""
    if spec.kind == "lark":
        return ["lark", spec.text]
    if spec.kind == "json":
        return ["guidance" if uses_guidance(spec) else "json_schema", spec.text]
    if spec.kind == "json_object":
        return ["json_schema", ANY_JSON_OBJECT]
    if spec.kind == "regex":
        return ["regex", spec.text]
    if spec.kind == "choice":
        return ["ebnf", choice_ebnf(spec)]
    return ["ebnf", spec.text]


class GrammarLoader:
    """Prepared specs -> compiled grammars for one tokenizer_info, in this process, kept in
    an LRU cache by spec; thread-safe. Only for Prepared values: their specs are known to
    compile within the bounds (runtime.speculation.grammar.compiler.GrammarCompiler).
    A JSON schema that xgrammar would not enforce (grammar.route), or a "lark" spec, loads as
    llguidance's grammar.guidance.GuidanceGrammar, its tokenizer built from the same
    tokenizer_info."""

    def __init__(self, info: xgr.TokenizerInfo, cache_size: int = CACHE_SIZE):
        self.info = info
        self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=False)
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._guidance_tokenizer: Any = None  # llguidance's, made by the first such grammar

    def load(self, prepared: Prepared) -> Any:
        """xgrammar's CompiledGrammar or a GuidanceGrammar (what GrammarWindow takes)."""
        with self._lock:
            compiled = self._cache.get(prepared.spec)
            if compiled is None:
                compiled = self._build(prepared)
                self._cache[prepared.spec] = compiled
            self._cache.move_to_end(prepared.spec)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return compiled

    def _build(self, prepared: Prepared) -> Any:
        job = job_of(prepared.spec)
        if job[0] in ("guidance", "lark"):
            from runtime.speculation.grammar import guidance

            if self._guidance_tokenizer is None:
                self._guidance_tokenizer = guidance.guidance_tokenizer(self.info)
            build = guidance.lark_grammar if job[0] == "lark" else guidance.guidance_grammar
            return build(self._guidance_tokenizer, job[1], self.info.stop_token_ids)
        if prepared.wire is not None:
            return from_wire(prepared.wire, self.info)
        return compile_job(self._compiler, job, JSON_OPTIONS)
