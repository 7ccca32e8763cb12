"""The process that compiles grammars, both ends: `CompileProcess` (the parent's handle, every
read and write bounded by a deadline) and `main()` (the child, run as a script by path).

xgrammar's compile cannot be interrupted and some schemas take minutes (a nested pattern such
as "(.{1,30}){1,30}" inside a JSON schema: 137 s) or gigabytes (an object of 1000 optional
properties); a thread could only be abandoned, still burning a core. A child process is killed
when its deadline passes, and its address space is limited, so both the time and the memory of
a compile are bounded.

Frames on the child's stdin/stdout: 4-byte big-endian length, then the payload.
parent -> child: the settings (JSON), the tokenizer info (xgrammar's JSON), then one job per
compile (JSON [method, source]). child -> parent: b"ready" once, then per job b"\\x00" + the
compiled grammar's wire form (to_wire; empty: the workers
compile the spec themselves, see grammar.load) or b"\\x01" + the error message (UTF-8).
"""

from __future__ import annotations

import json
import os
import re
import select
import struct
import subprocess
import sys
import time
import zlib
from typing import IO, Any

_LENGTH = struct.Struct(">I")
OK, FAILED = b"\x00", b"\x01"
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: (Check failed: )?")


class CompileTimeout(Exception):
    """The child did not answer by the deadline (it has been killed)."""


class CompileProcess:
    """A running child; `run` sends one job and waits for its answer until a deadline."""

    def __init__(self, settings: dict[str, Any], tokenizer_info_json: str):
        self._proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        os.set_blocking(self._proc.stdin.fileno(), False)
        self._greeting = [json.dumps(settings).encode(), tokenizer_info_json.encode()]
        self._ready = False

    def run(self, job: list[str], timeout_s: float, startup_timeout_s: float) -> bytes:
        """The answer to `job` (OK or FAILED + payload) within timeout_s (after the child's
        start, itself within startup_timeout_s); CompileTimeout (the child killed) past it,
        RuntimeError when the child died or did not start."""
        if not self._ready:
            deadline = time.monotonic() + startup_timeout_s
            for frame in self._greeting:
                self._send(frame, deadline)
            if self._receive(deadline) != b"ready":
                raise RuntimeError("the grammar compile process did not start")
            self._ready = True
        deadline = time.monotonic() + timeout_s
        self._send(json.dumps(job).encode(), deadline)
        return self._receive(deadline)

    def stop(self) -> None:
        """Kill the child and reap it."""
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe is not None:
                pipe.close()

    def _send(self, payload: bytes, deadline: float) -> None:
        assert self._proc.stdin is not None
        fd, data = self._proc.stdin.fileno(), memoryview(_LENGTH.pack(len(payload)) + payload)
        while data:
            self._wait(select.select([], [fd], [], self._left(deadline))[1])
            try:
                data = data[os.write(fd, data) :]
            except BrokenPipeError:
                raise RuntimeError(self._died()) from None

    def _receive(self, deadline: float) -> bytes:
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        header = self._read(fd, _LENGTH.size, deadline)
        return self._read(fd, _LENGTH.unpack(header)[0], deadline)

    def _read(self, fd: int, size: int, deadline: float) -> bytes:
        chunks: list[bytes] = []
        while size:
            self._wait(select.select([fd], [], [], self._left(deadline))[0])
            chunk = os.read(fd, min(size, 1 << 20))
            if not chunk:
                raise RuntimeError(self._died())
            chunks.append(chunk)
            size -= len(chunk)
        return b"".join(chunks)

    def _wait(self, ready: list) -> None:
        if not ready:
            self.stop()
            raise CompileTimeout()

    def _left(self, deadline: float) -> float:
        return max(0.0, deadline - time.monotonic())

    def _died(self) -> str:
        self.stop()
        return f"the grammar compile process died (exit code {self._proc.returncode})"


def clean_error(error: BaseException) -> str:
    """xgrammar's message without its C++ log prefix ('[12:00:00] /project/cpp/x.cc:94: ')."""
    text = str(error).strip() or type(error).__name__
    return _CPP_PREFIX.sub("", text.splitlines()[0] if text else text)


def _read_frame(stream: IO[bytes]) -> bytes | None:
    header = stream.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        return None
    return stream.read(_LENGTH.unpack(header)[0])


def _write_frame(stream: IO[bytes], payload: bytes) -> None:
    stream.write(_LENGTH.pack(len(payload)) + payload)
    stream.flush()


def _limit_memory(extra_bytes: int) -> None:
    """Address space: what the child maps now (interpreter, torch, the tokenizer) + extra."""
    import resource

    with open("/proc/self/status") as status:
        vm = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = vm + extra_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard < 0 else min(limit, hard), hard))


def compile_job(compiler: Any, job: list[str], json_options: dict[str, Any]) -> Any:
    """Compile [method, source] (runtime.speculation.grammar.compiler.job_of) with an
    xgrammar GrammarCompiler: here in the child, and where a worker rebuilds a grammar."""
    method, source = job
    if method == "json_schema":
        return compiler.compile_json_schema(source, **json_options)
    if method == "regex":
        return compiler.compile_regex(source)
    return compiler.compile_grammar(source)


def _probe(matcher: Any, vocab: int, settings: dict[str, Any]) -> str | None:
    """Time the token masks of the first positions (each advancing by the highest allowed
    token id that is not a stop token); a message when one is too slow. `matcher`: xgrammar's
    GrammarMatcher or grammar.guidance.GuidanceMatcher."""
    import torch
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab)
    shifts = torch.arange(32, dtype=torch.int32)
    stops = set(matcher.stop_token_ids)
    for step in range(settings["probe_steps"]):
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        took = time.perf_counter() - start
        if took > settings["probe_mask_s"]:
            return (
                f"its token masks are too slow to speculate with ({took * 1e3:.0f} ms for one "
                f"position after {step} tokens; the limit is {settings['probe_mask_s'] * 1e3:.0f}"
                " ms)"
            )
        allowed = ((bitmask[0, :, None] >> shifts) & 1).flatten()[:vocab].nonzero().flatten()
        candidates = [t for t in allowed.tolist() if t not in stops]
        if not candidates or not matcher.accept_token(candidates[-1]):
            break
    return None


def _answer(compiler: Any, settings: dict[str, Any], job: bytes) -> bytes:
    """OK + the wire form, or OK alone (the workers compile the spec again: it compiled
    fast, or its wire form would be too large), or FAILED + why."""
    try:
        method, source = json.loads(job)
        if method in ("guidance", "lark"):
            return _answer_guidance(settings, method, source)
        start = time.perf_counter()
        compiled = compile_job(compiler, [method, source], settings["json_options"])
        took = time.perf_counter() - start
        refusal = _refusal(compiled, settings)
        if refusal is not None:
            return FAILED + refusal.encode()
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/...
        if isinstance(e, MemoryError) or "bad_alloc" in str(e):
            return FAILED + b"compiling ran out of its memory limit"
        return FAILED + clean_error(e).encode()
    if took <= settings["local_compile_s"]:
        return OK
    wire = to_wire(compiled, settings["max_wire_bytes"])
    if wire is None and took > settings["worker_compile_s"]:
        why = f"it compiles in {took:.1f} s, too long for the workers, and is too large to send"
        return FAILED + why.encode()
    return OK + (wire or b"")


def to_wire(compiled: Any, limit: int | None = None) -> bytes | None:
    """The compiled grammar as bytes for a worker: xgrammar's JSON without the tokenizer,
    zlib level 1 (runtime.speculation.grammar.load.from_wire reads it); None when its JSON
    would take more than `limit` characters."""
    if limit is not None and _wire_estimate(compiled) > limit:
        return None
    try:
        text = compiled.serialize_json()
    except Exception:
        if limit is None:
            raise
        return None
    if limit is not None and len(text) > limit:
        return None
    return zlib.compress(text.encode(), 1)


def _wire_estimate(compiled: Any) -> int:
    """An upper estimate of serialize_json's length, which holds a copy of the grammar's FSM
    per rule: rules x EBNF length x 12 (measured 3.5 to 12 for the FSM's JSON per EBNF byte)."""
    ebnf = str(compiled.grammar)
    return ebnf.count("::=") * len(ebnf) * 12


def _refusal(compiled: Any, settings: dict[str, Any]) -> str | None:
    import xgrammar as xgr

    if compiled.memory_size_bytes > settings["max_grammar_bytes"]:
        size = compiled.memory_size_bytes / 2**20
        limit = settings["max_grammar_bytes"] / 2**20
        return f"the compiled grammar takes {size:.0f} MiB, over the limit of {limit:.0f} MiB"
    return _probe(xgr.GrammarMatcher(compiled), compiled.tokenizer_info.vocab_size, settings)


_GUIDANCE: dict[str, Any] = {}  # the llguidance tokenizer, made by the first such job


def _answer_guidance(settings: dict[str, Any], method: str, source: str) -> bytes:
    """A JSON schema ("guidance") or a Lark grammar ("lark": a forced tool call) for
    llguidance (runtime.speculation.grammar.route): validated, its first masks timed; OK
    alone (the workers build it again: a millisecond) or FAILED + why."""
    from runtime.speculation.grammar import guidance

    info = settings["tokenizer_info"]
    if "tokenizer" not in _GUIDANCE:
        _GUIDANCE["tokenizer"] = guidance.guidance_tokenizer(info)
    check = guidance.validate_lark if method == "lark" else guidance.validate
    compiled = check(_GUIDANCE["tokenizer"], source, info.stop_token_ids)
    if isinstance(compiled, str):
        return FAILED + compiled.encode()
    try:
        matcher = guidance.GuidanceMatcher(compiled, None)
        refusal = _probe(matcher, compiled.vocab_size, settings)
    except guidance.GuidanceError as e:
        refusal = str(e)
    return OK if refusal is None else FAILED + refusal.encode()


def main() -> None:
    """The child: answer jobs until stdin closes (the parent ended or stopped it)."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    import xgrammar as xgr

    stdin, stdout = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever xgrammar or torch prints goes to stderr, never into a frame
    settings_frame, info_frame = _read_frame(stdin), _read_frame(stdin)
    if settings_frame is None or info_frame is None:
        return
    settings = json.loads(settings_frame)
    info = xgr.TokenizerInfo.deserialize_json(info_frame.decode())
    settings["tokenizer_info"] = info  # llguidance's vocabulary too (_answer_guidance)
    compiler = xgr.GrammarCompiler(info, max_threads=settings["threads"], cache_enabled=False)
    _limit_memory(settings["memory_bytes"])
    _write_frame(stdout, b"ready")
    while (job := _read_frame(stdin)) is not None:
        _write_frame(stdout, _answer(compiler, settings, job))


if __name__ == "__main__":
    main()
