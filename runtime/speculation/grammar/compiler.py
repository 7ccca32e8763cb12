"""The orchestrator's side: compiling a GrammarSpec for one tokenizer, bounded in time and
memory, into what the workers need (grammar.load.Prepared).

xgrammar's compile cannot be interrupted, and some specs take minutes or gigabytes, so it runs
in a child process (runtime.speculation.grammar.child), killed when COMPILE_TIMEOUT_S passes,
with COMPILE_MEMORY_BYTES of address space beyond what it maps at start. After compiling, the
child times the token masks of the first PROBE_STEPS positions and refuses a grammar whose
masks take over PROBE_MASK_S each (nested ambiguous repetitions such as the regex
"(.{1,30}){1,30}" compile in 0.2 s but need 0.2 s, then 1.5 s, then 3 s per mask). Results
and refusals alike are kept in an LRU cache by spec (a refusal for time too: trying again
would burn as long again), except failures of the child itself.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from runtime.speculation.grammar.child import OK, CompileProcess, CompileTimeout, to_wire
from runtime.speculation.grammar.load import (
    CACHE_SIZE,
    COMPILE_THREADS,
    JSON_OPTIONS,
    LOCAL_COMPILE_S,
    WORKER_COMPILE_S,
    GrammarLoader,
    Prepared,
    from_wire,
    job_of,
    tokenizer_info,
)
from runtime.speculation.grammar.route import uses_guidance
from runtime.speculation.grammar.spec import GrammarSpec

__all__ = ["GrammarCompiler", "Prepared", "from_wire", "to_wire", "tokenizer_info"]

COMPILE_TIMEOUT_S = 5.0  # one compile with its probe and serializing; the child is killed past it
STARTUP_TIMEOUT_S = 60.0  # the child's start (it imports xgrammar, hence torch: about 2.5 s)
COMPILE_MEMORY_BYTES = 2 << 30  # address space one compile may add
MAX_GRAMMAR_BYTES = 32 << 20  # xgrammar's estimate of a compiled grammar's size
MAX_WIRE_BYTES = 64 << 20  # a compiled grammar's serialized JSON
PROBE_STEPS = 8  # positions whose masks are timed after compiling
PROBE_MASK_S = 0.05  # the most one of those masks may take


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer in a bounded child process (started at once,
    in the background); thread-safe, one compile at a time. Use as a context manager or call
    close(); the child also ends when this process does.

    prepare(spec) is what the orchestrator sends to the workers (each rebuilds it with a
    grammar.load.GrammarLoader); compile(spec) is the compiled grammar here."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int] | None = None,
        *,
        cache_size: int = CACHE_SIZE,
        timeout_s: float = COMPILE_TIMEOUT_S,
    ):
        self.tokenizer_info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.loader = GrammarLoader(self.tokenizer_info, cache_size)
        self._cache_size = cache_size
        self._cache: OrderedDict[GrammarSpec, Prepared | str] = OrderedDict()
        self._lock = threading.Lock()
        self._info_json = self.tokenizer_info.serialize_json()
        self._slot = _Slot(self._start())
        weakref.finalize(self, self._slot.stop)  # also at exit: no child outlives this process

    def prepare(self, spec: GrammarSpec) -> Prepared:
        """`spec` checked to compile within the bounds (cached), as the workers get it;
        ValueError naming spec.argument when it does not compile, exceeds a bound, or runs
        out of time."""
        with self._lock:
            prepared = self._cache.get(spec)
            if prepared is None:
                prepared, keep = self._prepare(spec)
                if keep:
                    self._cache[spec] = prepared
            if spec in self._cache:
                self._cache.move_to_end(spec)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        if isinstance(prepared, str):
            raise spec.error(prepared)
        return prepared

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of `spec` in this process (prepare, then load): xgrammar's
        CompiledGrammar, or a grammar.guidance.GuidanceGrammar (grammar.route)."""
        return self.loader.load(self.prepare(spec))

    def close(self) -> None:
        """Stop the child; a later compile starts a new one."""
        with self._lock:
            self._slot.stop()

    def __enter__(self) -> GrammarCompiler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _prepare(self, spec: GrammarSpec) -> tuple[Prepared | str, bool]:
        """The prepared spec or the message of its refusal, and whether to cache it."""
        if self._slot.process is None:
            self._slot.process = self._start()
        try:
            answer = self._slot.process.run(job_of(spec), self.timeout_s, STARTUP_TIMEOUT_S)
        except CompileTimeout:
            self._slot.process = self._start()  # the killed child's successor starts at once
            return f"compiling took longer than {self.timeout_s:g} s", True
        except RuntimeError as e:  # the child died: not the spec's fault, as far as we know
            self._slot.process = self._start()
            return f"the grammar was not compiled: {e}", False
        if answer[:1] != OK:
            if uses_guidance(spec):  # llguidance's refusal, told as such (grammar.guidance)
                return answer[1:].decode(), True
            return f"the {spec.kind} does not compile: {answer[1:].decode()}", True
        return Prepared(spec, answer[1:] or None), True

    def _start(self) -> CompileProcess:
        settings = {
            "threads": COMPILE_THREADS,
            "json_options": JSON_OPTIONS,
            "memory_bytes": COMPILE_MEMORY_BYTES,
            "max_grammar_bytes": MAX_GRAMMAR_BYTES,
            "max_wire_bytes": MAX_WIRE_BYTES,
            "local_compile_s": LOCAL_COMPILE_S,
            "worker_compile_s": WORKER_COMPILE_S,
            "probe_steps": PROBE_STEPS,
            "probe_mask_s": PROBE_MASK_S,
        }
        return CompileProcess(settings, self._info_json)


class _Slot:
    """The compiler's current child (replaced after a kill), reachable by its finalizer."""

    def __init__(self, process: CompileProcess):
        self.process: CompileProcess | None = process

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None
