"""Client handle for a running tandem server (`tandem serve`, or the one Engine.launch starts).

One I/O thread owns the ZeroMQ socket; calls from any thread hand it messages through a
queue (and wake it through a pipe, so a message leaves at once) and wait on their own reply
queue, so one Client serves many threads and streams at once.
A server that stops answering (no reply to pings within `dead_after_s`) or whose process has
exited makes every waiting call raise EngineDeadError.
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
from typing import Callable, Iterator

import zmq

from runtime.control import auth, protocol
from runtime.errors import EngineClosedError, EngineDeadError
from runtime.api.outputs import GenerationOutput, StreamDelta
from runtime.params import SamplingParams, check_prompt_ids
from runtime.control.procwatch import ProcessWatch, parent_pid

_END = object()
WORKER_DEATH_GRACE_S = 2.0   # how long a live server gets to report a dead local worker
IO_JOIN_S = 5.0              # how long close() waits for the I/O thread to end


class _Waker:
    """A pipe whose read end the I/O thread polls: a byte written to it wakes the thread.
    The I/O thread closes it as it ends; a wake after that does nothing. The lock keeps a
    closed descriptor's number, which the OS may have handed out again, from being written."""

    def __init__(self):
        self._lock = threading.Lock()
        self.read_fd, self._write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self._write_fd, False)

    def wake(self) -> None:
        with self._lock:
            if self._write_fd is None:
                return
            try:
                os.write(self._write_fd, b"w")
            except OSError:
                pass   # the pipe is full: a wake is pending

    def drain(self) -> None:
        try:
            while os.read(self.read_fd, 4096):
                pass
        except OSError:   # BlockingIOError: drained
            pass

    def close(self) -> None:
        with self._lock:
            if self._write_fd is not None:
                os.close(self.read_fd)
                os.close(self._write_fd)
                self._write_fd = None


def _close_client(closed: threading.Event, lock: threading.Lock, waiters: dict,
                  waker: _Waker, thread: threading.Thread, message: str) -> None:
    """The Client's part of close(): no new call gets in, every waiting call raises
    EngineClosedError (first, so that none waits on what follows), then the I/O thread
    ends. Holds no reference to the Client (its finalizer calls this)."""
    with lock:   # _open registers under this lock: a call is either failed here or refused
        closed.set()
        pending = list(waiters.values())
    for waiter in pending:
        waiter.put({"type": "failed", "id": "", "message": message, "kind": "dead",
                    "closed": True})
    waker.wake()
    if thread is not threading.current_thread():   # the finalizer may run on the I/O thread
        thread.join(IO_JOIN_S)


def _run_closers(closers: list[Callable[[], None]]) -> None:
    for close in closers:
        close()


def _dead_error(msg: dict) -> EngineDeadError:
    return (EngineClosedError if msg.get("closed") else EngineDeadError)(msg["message"])


class Client:
    POLL_MS = 20   # the I/O thread's longest wait (pings, liveness checks); messages wake it
    NAME = "client"   # in the message of EngineClosedError

    def __init__(self, address: str, *, auth_key_file: str | None = None,
                 dead_after_s: float = 30.0, ping_s: float = 1.0):
        self.address = address
        self._key = None if auth_key_file is None else auth.load_key(auth_key_file)
        self.dead_after_s = dead_after_s
        self.ping_s = ping_s
        self._context = zmq.Context()
        self._outbox: queue.Queue = queue.Queue()
        self._waker = _Waker()
        self._waiters: dict[str, queue.Queue] = {}
        self._lock = threading.Lock()
        self._dead: str | None = None
        self._closed = threading.Event()
        self._last_heard = time.monotonic()
        self._info: dict | None = None
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:12]
        self._thread = threading.Thread(
            target=Client._io_main, name="tandem-client", daemon=True,
            args=(weakref.ref(self), self._closed, self._context, self._waker))
        # what close() runs, in order; subclasses append theirs (none may refer to self)
        self._closers: list[Callable[[], None]] = [functools.partial(
            _close_client, self._closed, self._lock, self._waiters, self._waker,
            self._thread, f"{self.NAME} is closed")]
        self._finalizer = weakref.finalize(self, _run_closers, self._closers)
        self._thread.start()

    # --- liveness hooks (Engine overrides) -----------------------------------------------
    def _process_gone(self) -> str | None:
        return None

    # --- I/O thread ----------------------------------------------------------------------
    @staticmethod
    def _io_main(ref: weakref.ref, closed: threading.Event, context: zmq.Context,
                 waker: _Waker) -> None:
        """The I/O thread. It holds its Client only while it works, never while it waits in
        poll: a Client nobody else holds is collected (its finalizer closes it). It owns the
        socket, the context and the wake pipe, and closes them as it ends."""
        client = ref()
        sock = watch = None
        try:
            if client is not None:   # else collected before this thread ran
                sock, poller = client._connect()
                watch = client._watch
            last_ping = 0.0
            while client is not None and not closed.is_set():
                last_ping = client._before_poll(sock, last_ping)
                poll_ms, client = client.POLL_MS, None
                ready = dict(poller.poll(poll_ms))
                client = ref()
                if client is not None:
                    client._after_poll(sock, ready)
        except Exception as exc:  # noqa: BLE001 - every waiting call is told, none hangs
            client = ref() if client is None else client
            if client is not None:
                client._mark_dead(f"the client's I/O thread failed: {exc!r}")
            raise
        finally:
            client = None
            if watch is not None:
                watch.close()
            if sock is not None:
                sock.close(0)
            context.term()
            waker.close()

    def _connect(self) -> tuple[zmq.Socket, zmq.Poller]:
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        sock.connect(self.address)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._waker.read_fd, zmq.POLLIN)
        self._watch = ProcessWatch(poller)   # the server's processes, once it says which
        return sock, poller

    def _before_poll(self, sock: zmq.Socket, last_ping: float) -> float:
        """Send what is queued, and a ping when one is due; the time of the last ping."""
        self._flush_outbox(sock)
        now = time.monotonic()
        if now - last_ping >= self.ping_s:
            last_ping = now
            self._try_send(sock, {"type": "ping", "id": "ping"})
        return last_ping

    def _after_poll(self, sock: zmq.Socket, ready: dict) -> None:
        if self._waker.read_fd in ready:
            self._waker.drain()
        self._watch.collect(ready)
        if sock in ready:
            self._receive(sock.recv())
        self._check_dead()

    def _try_send(self, sock: zmq.Socket, msg: dict) -> None:
        try:
            sock.send(protocol.encode(msg, self._key), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _post(self, msg: dict) -> None:
        """Queue msg for the I/O thread and wake it."""
        self._outbox.put(msg)
        self._waker.wake()

    def _flush_outbox(self, sock: zmq.Socket) -> None:
        while True:
            try:
                msg = self._outbox.get_nowait()
            except queue.Empty:
                return
            self._try_send(sock, msg)

    def _receive(self, frame: bytes) -> None:
        try:
            msg = protocol.decode(frame, self._key)
        except protocol.ProtocolError:
            return
        self._last_heard = time.monotonic()
        if msg["type"] == "pong":
            if self._info is None:
                self._watch_processes(msg["info"])
            self._info = msg["info"]
            waiter = self._waiters.get(msg["id"])
        else:
            waiter = self._waiters.get(msg["id"])
        if waiter is not None:
            waiter.put(msg)

    def _watch_processes(self, info: dict) -> None:
        """Watch the server's processes that run on this host (pidfds): the server, and the
        workers that are not its children (mpirun, torchrun). Its own children it watches
        itself, and they die with it."""
        try:
            server_host, server_pid = info["server"]
            self._watch.add("server", server_host, server_pid)
            for rank, (host, pid) in info["processes"].items():
                if parent_pid(pid) != server_pid:
                    self._watch.add(int(rank), host, pid)
        except (KeyError, TypeError, ValueError):   # an older or foreign server: no table
            pass

    def _worker_death(self) -> str | None:
        """A worker on this host died and the server has not told us why: name the first
        rank that died, at once if the server ended after it (under mpirun the process
        manager may kill the server before it can report), else after
        WORKER_DEATH_GRACE_S. A server that ended first (or seen in the same poll) is the
        cause itself: its workers die with it."""
        deaths = [(key, pid, at) for key, pid, at in self._watch.ended if key != "server"]
        if not deaths:
            return None
        rank, pid, at = deaths[0]
        server_at = self._server_end()
        if server_at is not None:
            return None if server_at <= at else \
                f"rank {rank} (pid {pid}) died; the server exited before it reported it"
        if time.monotonic() - at > WORKER_DEATH_GRACE_S:
            return f"rank {rank} (pid {pid}) died; the server did not report it within " \
                   f"{WORKER_DEATH_GRACE_S:.0f} s"
        return None

    def _server_end(self) -> float | None:
        return next((at for key, _, at in self._watch.ended if key == "server"), None)

    def _check_dead(self) -> None:
        # a worker that died before the server names the cause the server's exit would hide
        reason = self._worker_death() if self._waiters else None
        reason = reason or self._process_gone()
        if reason is None and self._server_end() is not None:
            reason = f"tandem server (pid {self._info['server'][1]}) is gone"
        if reason is None and self._waiters and \
                time.monotonic() - self._last_heard > self.dead_after_s:
            reason = f"server at {self.address} silent for {self.dead_after_s:.0f} s"
        if reason is not None:
            self._mark_dead(reason)

    def _mark_dead(self, reason: str) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = reason
            waiters = list(self._waiters.values())
        for waiter in waiters:
            waiter.put({"type": "failed", "id": "", "message": reason, "kind": "dead"})

    # --- calls ---------------------------------------------------------------------------
    def _new_id(self) -> str:
        return f"{self._prefix}-{os.getpid()}-{next(self._ids)}"

    def _open(self, msg: dict, waiter=None):
        """Register a waiter for msg["id"] (a queue.Queue unless given: anything with
        put()) and queue msg for sending."""
        waiter = queue.Queue() if waiter is None else waiter
        with self._lock:   # close() fails the registered waiters under this lock
            if self._closed.is_set():
                raise EngineClosedError(f"{self.NAME} is closed")
            if self._dead is not None:
                raise EngineDeadError(self._dead)
            self._waiters[msg["id"]] = waiter
        self._last_heard = max(self._last_heard, time.monotonic() - 1.0)
        self._post(msg)
        return waiter

    def _close_waiter(self, rid: str) -> None:
        with self._lock:
            self._waiters.pop(rid, None)

    def _next(self, waiter: queue.Queue) -> dict:
        msg = waiter.get()
        if msg["type"] == "failed":
            if msg["kind"] == "dead":
                raise _dead_error(msg)
            raise ValueError(msg["message"])
        return msg

    def info(self, timeout_s: float = 30.0) -> dict:
        """Server facts (vocab_size, max_seq_len, ...); waits until the server answers."""
        rid = "ping-" + self._new_id()
        waiter = self._open({"type": "ping", "id": rid})
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    msg = waiter.get(timeout=0.2)
                except queue.Empty:
                    if time.monotonic() > deadline:
                        raise EngineDeadError(f"no answer from {self.address} "
                                              f"within {timeout_s:.0f} s") from None
                    self._post({"type": "ping", "id": rid})
                    continue
                if msg["type"] == "failed":
                    raise _dead_error(msg)
                return msg["info"]
        finally:
            self._close_waiter(rid)

    def stats(self, timeout_s: float = 30.0) -> dict:
        """Server statistics: running and queued requests, tokens generated, acceptance rate,
        tokens/s, mean round and prefill times (and per-phase times when profiling)."""
        rid = "stats-" + self._new_id()
        waiter = self._open({"type": "stats", "id": rid})
        try:
            msg = waiter.get(timeout=timeout_s)
        except queue.Empty:
            raise EngineDeadError(f"no answer from {self.address} within {timeout_s:.0f} s") \
                from None
        finally:
            self._close_waiter(rid)
        if msg["type"] == "failed":
            raise _dead_error(msg)
        return msg["stats"]

    def _request(self, prompt, prompt_token_ids, kwargs, stream: bool, chat: bool
                 ) -> tuple[dict, bool]:
        params = SamplingParams.from_kwargs(**kwargs).to_dict()
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompt or prompt_token_ids")
        msg = {"type": "generate", "id": self._new_id(), "params": params, "stream": stream,
               "chat": chat}
        if prompt is not None:
            single = isinstance(prompt, str)
            prompts = [prompt] if single else list(prompt)
            if not prompts or not all(isinstance(p, str) and p for p in prompts):
                raise ValueError("prompt: expected a non-empty string or list of strings")
            msg["prompts"] = prompts
        else:
            lists, single = _id_lists(prompt_token_ids)
            info = self._info or self.info()
            for row in lists:
                check_prompt_ids(row, info["vocab_size"])
                if len(row) + params["max_new_tokens"] > info["max_seq_len"]:
                    raise ValueError(
                        f"max_new_tokens: prompt ({len(row)} tokens) + max_new_tokens "
                        f"({params['max_new_tokens']}) exceeds max_seq_len "
                        f"({info['max_seq_len']})")
            msg["prompt_ids"] = lists
        return msg, single

    def generate(self, prompt=None, *, prompt_token_ids=None, chat: bool = False, **kwargs):
        """One prompt in, one GenerationOutput out; a list in, a list out."""
        msg, single = self._request(prompt, prompt_token_ids, kwargs, stream=False, chat=chat)
        waiter = self._open(msg)
        try:
            while True:
                reply = self._next(waiter)
                if reply["type"] == "final":
                    break
        finally:
            self._close_waiter(msg["id"])
        outs = [GenerationOutput(o["text"], o["token_ids"], o["finish_reason"], o["stats"])
                for o in sorted(reply["outputs"], key=lambda o: o["index"])]
        return outs[0] if single else outs

    def stream(self, prompt=None, *, prompt_token_ids=None, chat: bool = False, **kwargs
               ) -> Iterator[StreamDelta]:
        """Yields StreamDelta as each round's tokens arrive (index says which prompt)."""
        msg, _ = self._request(prompt, prompt_token_ids, kwargs, stream=True, chat=chat)
        return self._stream(msg)

    def _stream(self, msg: dict) -> Iterator[StreamDelta]:
        waiter = self._open(msg)
        finished = False
        try:
            while True:
                reply = self._next(waiter)
                if reply["type"] == "final":
                    finished = True
                    return
                if reply["type"] == "delta":
                    yield StreamDelta(reply["text"], reply["token_ids"], reply["index"])
        finally:
            self._close_waiter(msg["id"])
            if not finished and self._dead is None and not self._closed.is_set():
                self._post({"type": "cancel", "id": msg["id"]})

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

    def metrics(self, timeout_s: float = 30.0) -> str:
        """The server's Prometheus metrics in the text exposition format (0.0.4), as
        `GET /metrics` serves them."""
        rid = "metrics-" + self._new_id()
        waiter = self._open({"type": "metrics", "id": rid})
        try:
            msg = waiter.get(timeout=timeout_s)
        except queue.Empty:
            raise EngineDeadError(f"no answer from {self.address} within {timeout_s:.0f} s") \
                from None
        finally:
            self._close_waiter(rid)
        if msg["type"] == "failed":
            raise _dead_error(msg)
        return msg["text"]


def _id_lists(ids) -> tuple[list[list[int]], bool]:
    """prompt_token_ids as a list of rows, and whether a single row was given."""
    if isinstance(ids, (list, tuple)) and ids:
        if all(isinstance(t, int) for t in ids):
            return [list(ids)], True
        if all(isinstance(row, (list, tuple)) for row in ids):
            return [list(row) for row in ids], False
    raise ValueError("prompt_token_ids: expected a non-empty list of token ids "
                     "or a list of such lists")
