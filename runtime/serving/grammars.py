"""Structured outputs on rank 0: each request's grammar checked to compile within the bounds
off the serving loop (one thread; xgrammar's compiler runs in its own child process, bounded
in time and memory: runtime.speculation.grammar.compiler), what the workers need to load it
handed to the request's sequences, and the vocabulary they need sent with the first until one
has gone through (runtime.speculation.grammar.book).
A grammar that does not compile fails its request with a ValueError naming the argument."""

from __future__ import annotations

import base64
import logging
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from runtime.errors import ArgumentError
from runtime.serving.sequence import Sequence

log = logging.getLogger("tandem.grammars")


class GrammarService:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, eos_token_ids
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._compiler: Any = None  # made by the first compile (it starts a child process)
        self._jobs: dict[str, tuple[list[Sequence], Future]] = {}
        self._vocab = ""  # base64 of the tokenizer info, once a compiler exists
        self.delivered = False  # a sequence with the vocabulary reached the workers

    @property
    def busy(self) -> bool:
        return bool(self._jobs)

    def submit(self, request_id: str, seqs: list[Sequence]) -> None:
        """Compile the grammar of these sequences (one request's) in the background."""
        from runtime.speculation.grammar.spec import parse_structured_outputs

        spec = parse_structured_outputs(seqs[0].params.structured_outputs)
        self._jobs[request_id] = (seqs, self._pool.submit(self._compile, spec))

    def finished(self) -> list[tuple[str, list[Sequence], ValueError | None]]:
        """The requests whose compile ended: (id, sequences ready to submit, None), or (id,
        sequences, the ValueError naming the argument)."""
        done: list[tuple[str, list[Sequence], ValueError | None]] = []
        for rid, (seqs, future) in list(self._jobs.items()):
            if not future.done():
                continue
            del self._jobs[rid]
            error = future.exception()
            if error is not None and not isinstance(error, ValueError):
                log.error("compiling a grammar failed: %r", error)
                words = f"structured_outputs: the grammar was not compiled: {error}"
                error = ArgumentError(words, "structured_outputs")
            if error is None:
                for seq in seqs:
                    seq.grammar = future.result()
                # the first sequence is admitted first (a request's end ends them all)
                seqs[0].grammar_vocab = "" if self.delivered else self._vocab
            done.append((rid, seqs, error))
        return done

    def forget(self, request_id: str) -> None:
        """A request ended before its grammar was compiled (the compile runs out)."""
        self._jobs.pop(request_id, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._compiler is not None:
            self._compiler.close()

    def _compile(self, spec: Any) -> tuple[str, str, str]:
        """(kind, text, wire): the spec checked to compile within the bounds, and its compiled
        form when compiling it takes long (else the workers compile it: faster than moving
        it; runtime.speculation.grammar.compiler.GrammarCompiler.prepare)."""
        from runtime.speculation.grammar.compiler import GrammarCompiler

        if self._compiler is None:
            if self.tokenizer is None:
                raise spec.error("grammars need a tokenizer; this model has none")
            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos)
            info = self._compiler.tokenizer_info.serialize_json().encode()
            self._vocab = base64.b64encode(zlib.compress(info, 1)).decode()
        prepared = self._compiler.prepare(spec)
        wire = "" if prepared.wire is None else base64.b64encode(prepared.wire).decode()
        return prepared.spec.kind, prepared.spec.text, wire
