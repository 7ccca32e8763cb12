"""Client handle for a running tandem server (`tandem serve`, or the one Engine.launch starts).

One I/O thread owns the ZeroMQ socket; calls from any thread hand it messages through a
queue (and wake it through a pipe, so a message leaves at once) and wait on their own reply
queue, so one Client serves many threads and streams at once.
A server that stops answering (no reply to pings within `dead_after_s`) or whose process has
exited makes every waiting call raise EngineDeadError.
"""
from __future__ import annotations

import itertools
import os
import queue
import threading
import time
import uuid
from typing import Iterator

import zmq

from runtime.control import auth, protocol
from runtime.errors import EngineDeadError
from runtime.api.outputs import GenerationOutput, StreamDelta
from runtime.params import SamplingParams, check_prompt_ids
from runtime.control.procwatch import ProcessWatch, parent_pid

_END = object()
WORKER_DEATH_GRACE_S = 2.0   # how long a live server gets to report a dead local worker


class Client:
    POLL_MS = 20   # the I/O thread's longest wait (pings, liveness checks); messages wake it

    def __init__(self, address: str, *, auth_key_file: str | None = None,
                 dead_after_s: float = 30.0, ping_s: float = 1.0):
        self.address = address
        self._key = None if auth_key_file is None else auth.load_key(auth_key_file)
        self.dead_after_s = dead_after_s
        self.ping_s = ping_s
        self._context = zmq.Context()
        self._outbox: queue.Queue = queue.Queue()
        self._wake_r, self._wake_w = os.pipe()   # a byte here wakes the I/O thread's poll
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._waiters: dict[str, queue.Queue] = {}
        self._lock = threading.Lock()
        self._dead: str | None = None
        self._closed = threading.Event()
        self._last_heard = time.monotonic()
        self._info: dict | None = None
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:12]
        self._thread = threading.Thread(target=self._io_loop, name="tandem-client", daemon=True)
        self._thread.start()

    # --- liveness hooks (Engine overrides) -----------------------------------------------
    def _process_gone(self) -> str | None:
        return None

    # --- I/O thread ----------------------------------------------------------------------
    def _io_loop(self) -> None:
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        sock.connect(self.address)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        self._watch = ProcessWatch(poller)   # the server's processes, once it says which
        last_ping = 0.0
        try:
            while not self._closed.is_set():
                self._flush_outbox(sock)
                now = time.monotonic()
                if now - last_ping >= self.ping_s:
                    last_ping = now
                    self._try_send(sock, {"type": "ping", "id": "ping"})
                ready = dict(poller.poll(self.POLL_MS))
                if self._wake_r in ready:
                    self._drain_wake()
                self._watch.collect(ready)
                if sock in ready:
                    self._receive(sock.recv())
                self._check_dead()
        finally:
            self._watch.close()
            sock.close(0)

    def _try_send(self, sock: zmq.Socket, msg: dict) -> None:
        try:
            sock.send(protocol.encode(msg, self._key), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _post(self, msg: dict) -> None:
        """Queue msg for the I/O thread and wake it."""
        self._outbox.put(msg)
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"w")
        except OSError:
            pass   # the pipe is full (a wake is pending) or closed (the client is closing)

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except OSError:   # BlockingIOError: drained
            pass

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
        if self._closed.is_set():
            raise EngineDeadError("client is closed")
        waiter = queue.Queue() if waiter is None else waiter
        with self._lock:
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
                raise EngineDeadError(msg["message"])
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
                    raise EngineDeadError(msg["message"])
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
            raise EngineDeadError(msg["message"])
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
        self._closed.set()
        self._wake()   # the I/O thread sees _closed at once
        self._thread.join(5)
        self._context.term()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

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
    raise ValueError("prompt_token_ids: expected a non-empty list of token ids "
                     "or a list of such lists")
