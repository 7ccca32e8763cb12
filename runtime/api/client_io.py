"""The I/O side of a Client (runtime.api.client): the thread that owns its ZeroMQ socket, and
the liveness rules it applies between polls (runtime.control.waker wakes it).

Liveness, checked after every poll (at most POLL_MS apart):
- a process of the server on this host that ended (pidfds, runtime.control.procwatch), or the
  Engine's own server process: every waiting call raises EngineDeadError naming it;
- a server that was reached once (heard from, or a connection made) and has said nothing for
  `dead_after_s` while calls wait (it answers pings on a thread of its own, however long a
  step runs: runtime.serving.client_door): those calls raise EngineDeadError and their
  requests are cancelled; a later call tries again, so a server that answers again is found;
- an address where nothing was ever reached: ZeroMQ connects lazily and retries for ever, so
  a missing server shows only as a connection that never happens (the socket monitor's
  EVENT_CONNECTED). A call that waits `connect_timeout_s` for one raises EngineDeadError
  "no tandem server at ADDRESS" and the next call tries again (a server may yet start there).
  Calls that ask to wait longer (info(timeout_s=...), which is how to wait for a server that
  is starting) are exempt.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from runtime.control import protocol
from runtime.control.procwatch import ProcessWatch, parent_pid
from runtime.control.protocol import Cancel, ClientReply, ClientRequest, Failed, Ping, Pong
from runtime.control.waker import Waker

WORKER_DEATH_GRACE_S = 2.0  # how long a live server gets to report a dead local worker
IO_JOIN_S = 5.0  # how long close() waits for the I/O thread to end


@dataclass(frozen=True, slots=True)
class ClosedFailure(Failed):
    """What a waiting call gets when its Client is closed (never sent): EngineClosedError."""


def _close_client(
    closed: threading.Event,
    lock: threading.Lock,
    waiters: dict,
    waker: Waker,
    thread: threading.Thread,
    message: str,
) -> None:
    """The Client's part of close(): no new call gets in, every waiting call raises
    EngineClosedError (first, so that none waits on what follows), then the I/O thread
    ends. Holds no reference to the Client (its finalizer calls this)."""
    with lock:  # _open registers under this lock: a call is either failed here or refused
        closed.set()
        pending = list(waiters.values())
    for waiter in pending:
        waiter.put(ClosedFailure("", message, "dead"))
    waker.wake()
    if thread is not threading.current_thread():  # the finalizer may run on the I/O thread
        thread.join(IO_JOIN_S)


def _run_closers(closers: list[Callable[[], None]]) -> None:
    for close in closers:
        close()


class ClientIO:
    """The Client's methods that run on its I/O thread (Client.__init__ sets the state)."""

    POLL_MS = 20  # the I/O thread's longest wait (pings, liveness checks); messages wake it

    address: str
    dead_after_s: float
    connect_timeout_s: float
    ping_s: float
    _key: bytes | None  # HMAC key of the frames (server.auth_key_file), or None
    _context: zmq.Context
    _waker: Waker
    _waiters: dict[str, queue.Queue]
    _outbox: queue.Queue
    _patience: dict[str, float]  # request id -> when it gives up on an unreached address
    _lock: threading.Lock
    _dead: str | None  # why the server is gone for good, once it is
    _last_heard: float
    _heard: bool
    _connected: bool
    _info: dict | None  # the server's facts, from its first pong
    # set by _connect on the I/O thread
    _monitor: zmq.Socket
    _poller: zmq.Poller
    _watch: ProcessWatch

    # --- liveness hooks (Engine overrides) -----------------------------------------------
    def _process_gone(self) -> str | None:
        return None

    # --- the thread ----------------------------------------------------------------------
    @staticmethod
    def _io_main(
        ref: weakref.ref, closed: threading.Event, context: zmq.Context, waker: Waker
    ) -> None:
        """The I/O thread. It holds its Client only while it works, never while it waits in
        poll: a Client nobody else holds is collected (its finalizer closes it). It owns the
        socket, the context and the wake pipe, and closes them as it ends."""
        client = ref()
        sock = watch = monitor = None
        try:
            if client is not None:  # else collected before this thread ran
                sock, poller, monitor = client._connect()
                watch = client._watch
            last_ping = 0.0
            while client is not None and not closed.is_set():
                last_ping = client._before_poll(sock, last_ping)
                poll_ms, client = client.POLL_MS, None
                ready = dict(poller.poll(poll_ms))
                client = ref()
                if client is not None:
                    client._after_poll(sock, ready)
        except Exception as exc:
            client = ref() if client is None else client
            if client is not None:
                client._mark_dead(f"the client's I/O thread failed: {exc!r}")
            raise
        finally:
            client = None
            if watch is not None:
                watch.close()
            if monitor is not None:
                monitor.close(0)
            if sock is not None:
                sock.close(0)
            context.term()
            waker.close()

    def _connect(self) -> tuple[zmq.Socket, zmq.Poller, zmq.Socket]:
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        # whether a connection is ever made: the one sign that something listens there
        self._monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED)
        sock.connect(self.address)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._waker.read_fd, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        self._poller = poller
        self._watch = ProcessWatch(poller)  # the server's processes, once it says which
        return sock, poller, self._monitor

    def _before_poll(self, sock: zmq.Socket, last_ping: float) -> float:
        """Send what is queued, and a ping when one is due; the time of the last ping."""
        self._flush_outbox(sock)
        now = time.monotonic()
        if now - last_ping >= self.ping_s:
            last_ping = now
            self._try_send(sock, Ping("ping"))
        return last_ping

    def _after_poll(self, sock: zmq.Socket, ready: dict) -> None:
        if self._waker.read_fd in ready:
            self._waker.drain()
        if self._monitor in ready:
            self._read_monitor(sock)
        self._watch.collect(ready)
        if sock in ready:
            self._receive(sock.recv())
        self._check_dead()

    def _read_monitor(self, sock: zmq.Socket) -> None:
        """Note a connection made; after the first, stop watching (the thread closes the
        monitor socket as it ends)."""
        while self._monitor.poll(0):
            if recv_monitor_message(self._monitor)["event"] == zmq.EVENT_CONNECTED:
                self._connected = True
        if self._connected:
            self._poller.unregister(self._monitor)
            sock.disable_monitor()

    def _try_send(self, sock: zmq.Socket, msg: ClientRequest) -> None:
        try:
            sock.send(protocol.encode(msg, self._key), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _post(self, msg: ClientRequest) -> None:
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
        self._heard = True
        if not isinstance(msg, ClientReply):  # no answer to a client
            return
        if isinstance(msg, Pong):
            if self._info is None:
                self._watch_processes(msg.info)
            self._info = msg.info
        waiter = self._waiters.get(msg.id)
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
        except (KeyError, TypeError, ValueError):  # an older or foreign server: no table
            pass

    # --- liveness ------------------------------------------------------------------------
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
            return (
                None
                if server_at <= at
                else f"rank {rank} (pid {pid}) died; the server exited before it reported it"
            )
        if time.monotonic() - at > WORKER_DEATH_GRACE_S:
            return (
                f"rank {rank} (pid {pid}) died; the server did not report it within "
                f"{WORKER_DEATH_GRACE_S:.0f} s"
            )
        return None

    def _server_end(self) -> float | None:
        return next((at for key, _, at in self._watch.ended if key == "server"), None)

    @property
    def _reached(self) -> bool:
        """Whether the server was ever heard from, or a connection to it made."""
        return self._heard or self._connected

    def _check_dead(self) -> None:
        # a worker that died before the server names the cause the server's exit would hide
        reason = self._worker_death() if self._waiters else None
        reason = reason or self._process_gone()
        if reason is None and self._server_end() is not None:
            assert self._info is not None  # the server is watched once its info came
            reason = f"tandem server (pid {self._info['server'][1]}) is gone"
        if reason is not None:
            self._mark_dead(reason)
        elif (
            self._waiters
            and self._reached
            and time.monotonic() - self._last_heard > self.dead_after_s
        ):
            self._fail_silent()
        elif self._patience and not self._reached:
            self._give_up_unreached()

    def _fail_silent(self) -> None:
        """The server, reached once, said nothing for dead_after_s (its pings are answered on
        a thread of their own, however long a step runs): every waiting call raises
        EngineDeadError, and its request is cancelled should the server still hold it. The
        client stays usable: a server that answers again serves the next call."""
        reason = f"server at {self.address} silent for {self.dead_after_s:.0f} s"
        with self._lock:
            waiting = list(self._waiters.items())
            self._waiters.clear()
            self._patience.clear()
        for rid, waiter in waiting:
            waiter.put(Failed("", reason, "dead"))
            self._outbox.put(Cancel(rid))

    def _give_up_unreached(self) -> None:
        """Fail the calls that waited connect_timeout_s for an address where nothing was
        ever reached. The client stays usable: a later call tries again."""
        now = time.monotonic()
        with self._lock:
            late = [rid for rid, until in self._patience.items() if now > until]
            for rid in late:
                del self._patience[rid]
            waiters = [self._waiters[rid] for rid in late if rid in self._waiters]
        if waiters:
            reason = self._nobody_there(f"no connection within {self.connect_timeout_s:g} s")
            for waiter in waiters:
                waiter.put(Failed("", reason, "dead"))

    def _nobody_there(self, waited: str) -> str:
        """Why a call failed at an address where nothing was ever reached."""
        path = self.address[len("ipc://") :] if self.address.startswith("ipc://") else None
        if path and not path.startswith("@") and not os.path.exists(path):
            waited = f"no socket file {path}"
        return f"no tandem server at {self.address}: nothing is listening there ({waited})"

    def _mark_dead(self, reason: str) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = reason
            waiters = list(self._waiters.values())
        for waiter in waiters:
            waiter.put(Failed("", reason, "dead"))
