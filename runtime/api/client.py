"""Client handle for a running tandem server (`tandem serve`, or the one Engine.launch starts).

One I/O thread owns the ZeroMQ socket (runtime.api.client_io); calls from any thread hand it
messages through a queue (and wake it through a pipe, so a message leaves at once) and wait on
their own reply queue, so one Client serves many threads and streams at once.
A server that stops answering (no reply to pings within `dead_after_s`) or whose process has
exited makes every waiting call raise EngineDeadError. At an address where nothing listens, a
call raises EngineDeadError("no tandem server at ADDRESS ...") after `connect_timeout_s`,
unless it asked to wait longer (info(timeout_s=...): waiting for a server that is starting).
close() makes every waiting call raise EngineClosedError at once, and every later call too.
A Client that nobody holds any more, or that is still open when the interpreter exits, is
closed by its finalizer (weakref.finalize): the I/O thread holds only a weak reference to
it while it waits, and the finalizer holds only the parts it closes.
"""

from __future__ import annotations

import functools
import itertools
import os
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from typing import TypeVar

import zmq

from runtime.api.client_io import (
    IO_JOIN_S,
    WORKER_DEATH_GRACE_S,
    ClientIO,
    ClosedFailure,
    _close_client,
    _run_closers,
)
from runtime.api.outputs import GenerationOutput, StreamDelta, entries
from runtime.api.tools.request import check_tools
from runtime.control import auth
from runtime.control.protocol import (
    Cancel,
    ClientReply,
    ClientRequest,
    Delta,
    Failed,
    Final,
    Generate,
    Metrics,
    MetricsReply,
    Ping,
    Pong,
    Stats,
    StatsReply,
)
from runtime.control.waker import Waker
from runtime.errors import (
    ArgumentError,
    EngineClosedError,
    EngineDeadError,
    EngineDrainingError,
    RequestCancelledError,
    naming,
)
from runtime.params import SamplingParams, check_fits, check_prompt_ids

__all__ = ["Client", "CONNECT_TIMEOUT_S", "IO_JOIN_S", "WORKER_DEATH_GRACE_S"]

CONNECT_TIMEOUT_S = 3.0  # how long a call waits for a connection to an unreached address
CALL_TIMEOUT_S = 30.0  # info / stats / metrics: how long a reached server gets to answer


A = TypeVar("A", StatsReply, MetricsReply)


def _dead_error(msg: Failed) -> EngineDeadError:
    return (EngineClosedError if isinstance(msg, ClosedFailure) else EngineDeadError)(msg.message)


class Client(ClientIO):
    NAME = "client"  # in the message of EngineClosedError

    def __init__(
        self,
        address: str,
        *,
        auth_key_file: str | None = None,
        dead_after_s: float = 30.0,
        ping_s: float = 1.0,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
    ):
        self.address = address
        self._key = None if auth_key_file is None else auth.load_key(auth_key_file)
        self.dead_after_s = dead_after_s
        self.connect_timeout_s = connect_timeout_s
        self.ping_s = ping_s
        self._context = zmq.Context()
        self._outbox: queue.Queue = queue.Queue()
        self._waker = Waker()
        self._waiters: dict[str, queue.Queue] = {}
        self._patience: dict[str, float] = {}
        self._lock = threading.Lock()
        self._dead: str | None = None
        self._closed = threading.Event()
        self._last_heard = time.monotonic()
        self._heard = self._connected = False  # ever: a frame from the server; a connection
        self._info: dict | None = None
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:12]
        self._thread = threading.Thread(
            target=Client._io_main,
            name="tandem-client",
            daemon=True,
            args=(weakref.ref(self), self._closed, self._context, self._waker),
        )
        # what close() runs, in order; subclasses append theirs (none may refer to self)
        self._closers: list[Callable[[], None]] = [
            functools.partial(
                _close_client,
                self._closed,
                self._lock,
                self._waiters,
                self._waker,
                self._thread,
                f"{self.NAME} is closed",
            )
        ]
        self._finalizer = weakref.finalize(self, _run_closers, self._closers)
        self._thread.start()

    # --- calls ---------------------------------------------------------------------------
    def _new_id(self) -> str:
        return f"{self._prefix}-{os.getpid()}-{next(self._ids)}"

    def _open(self, msg: ClientRequest, waiter=None, patient: bool = False):
        """Register a waiter for msg.id (a queue.Queue unless given: anything with
        put()) and queue msg for sending. Unless `patient`, the call gives up after
        connect_timeout_s if the server was never reached (runtime.api.client_io)."""
        waiter = queue.Queue() if waiter is None else waiter
        with self._lock:  # close() fails the registered waiters under this lock
            if self._closed.is_set():
                raise EngineClosedError(f"{self.NAME} is closed")
            if self._dead is not None:
                raise EngineDeadError(self._dead)
            self._waiters[msg.id] = waiter
            if not patient:
                self._patience[msg.id] = time.monotonic() + self.connect_timeout_s
        self._last_heard = max(self._last_heard, time.monotonic() - 1.0)
        self._post(msg)
        return waiter

    def _close_waiter(self, rid: str) -> None:
        with self._lock:
            self._waiters.pop(rid, None)
            self._patience.pop(rid, None)

    def _next(self, waiter: queue.Queue) -> ClientReply:
        msg = waiter.get()
        if isinstance(msg, Failed):
            if msg.kind == "dead":
                raise _dead_error(msg)
            if msg.kind == "cancelled":
                raise RequestCancelledError(msg.message)
            if msg.kind == "draining":
                raise EngineDrainingError(msg.message)
            if msg.param is not None:
                raise ArgumentError(msg.message, msg.param)
            raise ValueError(msg.message)
        return msg

    def _unanswered(self, timeout_s: float, starting: bool = False) -> EngineDeadError:
        if not self._reached:
            return EngineDeadError(self._nobody_there(f"waited {timeout_s:.0f} s"))
        if starting:
            return EngineDeadError(
                f"the server at {self.address} is still starting after "
                f"{timeout_s:.0f} s (its workers are loading)"
            )
        return EngineDeadError(f"no answer from {self.address} within {timeout_s:.0f} s")

    def info(self, timeout_s: float | None = None) -> dict:
        """Server facts (vocab_size, max_seq_len, ...); waits until the server answers, at
        most timeout_s (default 30 s). Without a timeout_s, at an address where nothing was
        ever reached it gives up after connect_timeout_s; with one, it waits that long for
        a server that is still starting."""
        patient = timeout_s is not None
        timeout_s = CALL_TIMEOUT_S if timeout_s is None else timeout_s
        rid = "ping-" + self._new_id()
        waiter = self._open(Ping(rid), patient=patient)
        try:
            deadline, starting = time.monotonic() + timeout_s, False
            while True:
                try:
                    msg = waiter.get(timeout=0.2)
                except queue.Empty:
                    msg = None
                if isinstance(msg, Failed):
                    raise _dead_error(msg)
                if isinstance(msg, Pong):
                    return msg.info
                starting |= msg is not None  # `starting`: alive, its workers loading
                if time.monotonic() > deadline:
                    raise self._unanswered(timeout_s, starting) from None
                if msg is None:
                    self._post(Ping(rid))
        finally:
            self._close_waiter(rid)

    def _ask(
        self, kind: type[Stats] | type[Metrics], answer: type[A], timeout_s: float | None
    ) -> A:
        """One question, one reply (stats, metrics); timeout_s as for info()."""
        patient = timeout_s is not None
        timeout_s = CALL_TIMEOUT_S if timeout_s is None else timeout_s
        rid = f"{kind.NAME}-" + self._new_id()
        waiter = self._open(kind(rid), patient=patient)
        try:
            msg = waiter.get(timeout=timeout_s)
        except queue.Empty:
            raise self._unanswered(timeout_s) from None
        finally:
            self._close_waiter(rid)
        if isinstance(msg, Failed):
            raise _dead_error(msg)
        if not isinstance(msg, answer):
            raise EngineDeadError(f"the server answered {kind.NAME!r} with {msg.NAME!r}")
        return msg

    def stats(self, timeout_s: float | None = None) -> dict:
        """Server statistics: running and queued requests, tokens generated, acceptance rate,
        tokens/s, mean round and prefill times (and per-phase times when profiling)."""
        return self._ask(Stats, StatsReply, timeout_s).stats

    def metrics(self, timeout_s: float | None = None) -> str:
        """The server's Prometheus metrics in the text exposition format (0.0.4), as
        `GET /metrics` serves them."""
        return self._ask(Metrics, MetricsReply, timeout_s).text

    def _request(
        self, prompt, prompt_token_ids, kwargs, stream: bool, chat: bool, tools=None
    ) -> tuple[Generate, bool]:
        params = SamplingParams.from_kwargs(**kwargs).to_dict()
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompt or prompt_token_ids")
        if tools is not None and not (chat and prompt is not None):
            raise ArgumentError("tools: only a chat prompt (chat=True) shows tools", "tools")
        rid = self._new_id()
        if prompt is not None:
            single = isinstance(prompt, str)
            prompts = [prompt] if single else list(prompt)
            if not prompts or not all(isinstance(p, str) and p for p in prompts):
                words = "prompt: expected a non-empty string or list of strings"
                raise ArgumentError(words, "prompt")
            with naming("tools"):
                tools = check_tools(tools) or None
            return Generate(rid, params, stream, prompts=prompts, chat=chat, tools=tools), single
        lists, single = _id_lists(prompt_token_ids)
        info = self._info or self.info()
        for index, row in enumerate(lists):
            check_prompt_ids(row, info["vocab_size"])
            check_fits(
                len(row),
                params["max_new_tokens"],
                info["max_seq_len"],
                "prompt_token_ids",
                index if len(lists) > 1 else None,
            )
        return Generate(rid, params, stream, prompt_ids=lists, chat=chat), single

    def generate(
        self, prompt=None, *, prompt_token_ids=None, chat: bool = False, tools=None, **kwargs
    ):
        """One prompt in, one GenerationOutput out; a list in, a list out. `chat`: each prompt
        is a user message through the chat template, which shows `tools` (OpenAI's function
        tools) when given."""
        msg, single = self._request(prompt, prompt_token_ids, kwargs, False, chat, tools)
        waiter = self._open(msg)
        try:
            while True:
                reply = self._next(waiter)
                if isinstance(reply, Final):
                    break
        finally:
            self._close_waiter(msg.id)
        outs = [GenerationOutput.of(o) for o in sorted(reply.outputs, key=lambda o: o["index"])]
        return outs[0] if single and len(outs) == 1 else outs

    def stream(
        self, prompt=None, *, prompt_token_ids=None, chat: bool = False, tools=None, **kwargs
    ) -> Iterator[StreamDelta]:
        """Yields StreamDelta as each round's tokens arrive (index says which prompt)."""
        msg, _ = self._request(prompt, prompt_token_ids, kwargs, True, chat, tools)
        return self._stream(msg)

    def _stream(self, msg: Generate) -> Iterator[StreamDelta]:
        waiter = self._open(msg)
        finished = False
        try:
            while True:
                reply = self._next(waiter)
                if isinstance(reply, Final):
                    finished = True
                    return
                if isinstance(reply, Delta):
                    yield StreamDelta(
                        reply.text, reply.token_ids, reply.index, entries(reply.logprobs)
                    )
        finally:
            self._close_waiter(msg.id)
            if not finished and self._dead is None and not self._closed.is_set():
                self._post(Cancel(msg.id))

    def close(self) -> None:
        """Every call still waiting, in any thread, raises EngineClosedError at once, and
        so does every later call; then the I/O thread ends. Idempotent, and safe from
        atexit handlers and __del__ (a second call, or one after the interpreter began
        to exit and closed it already, does nothing)."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _id_lists(ids) -> tuple[list[list[int]], bool]:
    """prompt_token_ids as a list of rows, and whether a single row was given."""
    if isinstance(ids, (list, tuple)) and ids:
        if all(isinstance(t, int) for t in ids):
            return [list(ids)], True
        if all(isinstance(row, (list, tuple)) for row in ids):
            return [list(row) for row in ids], False
    raise ArgumentError(
        "prompt_token_ids: expected a non-empty list of token ids or a list of such lists",
        "prompt_token_ids",
    )
