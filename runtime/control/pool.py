"""The orchestrator's side of the worker control plane.

One ROUTER socket; every worker connects a DEALER (identity b"w<rank>"). Each worker's Pulse
thread sends its heartbeats to a second ROUTER, which nobody waits on: the Beacon's thread
reads what came every quarter of the silence limit, and the pool before it judges heartbeat
ages (check_alive), so an idle orchestrator's main thread sleeps until a heartbeat could be
too old, not for each beat. The Beacon tells workers that the orchestrator lives. `command`
sends one step to every worker and waits for all of them, watching heartbeats and child
processes so that a dead or silent rank becomes EngineDeadError.

When one rank dies, its peers usually fail first in a collective ("connection reset by
peer") and report that error; the pool then names the rank that died without a word as the
cause (a child that exited, a rank on this host whose process is gone, or one whose
heartbeats stopped), not the peer.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Collection
from typing import TypeVar

import zmq

from runtime.control import auth, protocol
from runtime.control.commands import Command, Reply
from runtime.control.heartbeat import Beacon
from runtime.control.procwatch import ProcessWatch, proc_stat
from runtime.control.protocol import (
    Done,
    Error,
    Heartbeat,
    Hello,
    Init,
    Message,
    Ready,
    Shutdown,
    WorkerMessage,
)
from runtime.errors import EngineDeadError

log = logging.getLogger("tandem.pool")

# After a rank reports an error, wait at most this long for the process that caused it
# (a peer that died without a word) to show up before reporting the error as it is.
ATTRIBUTION_GRACE_S = 0.5
MAX_DRAIN = 10000  # frames read per drain (the socket's receive high-water mark)
DROP_LOG_S = 5.0  # at most one warning about dropped frames per this many seconds
PULSE_READ_SHARE = 0.25  # an idle pool reads the heartbeats every this share of dead_after_s

Liveness = Callable[..., "str | None"]  # liveness(exclude=ranks) -> why a rank is gone
Watch = Callable[[WorkerMessage | None], None]  # sees every message while the pool waits
W = TypeVar("W", bound=WorkerMessage)


class WorkerPool:
    def __init__(
        self,
        worker_ranks: tuple[int, ...],
        context: zmq.Context,
        bind: str = "tcp://127.0.0.1",
        heartbeat_s: float = 1.0,
        dead_after_s: float = 30.0,
        liveness: Liveness | None = None,
        key: bytes | None = None,
    ):
        self.ranks = tuple(worker_ranks)
        auth.check_control_bind(bind)
        # HMAC of every frame: the launch's key, else the key file's (if any)
        self.key = key if key is not None else auth.control_key()
        self.sock = context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.SNDHWM, 1000)
        self.sock.setsockopt(zmq.RCVHWM, MAX_DRAIN)
        port = self.sock.bind_to_random_port(bind)
        self.address = f"{bind}:{port}"
        self.pulses = context.socket(zmq.ROUTER)  # the Pulse threads' heartbeats
        self.pulses.setsockopt(zmq.LINGER, 0)
        self.pulses.setsockopt(zmq.RCVHWM, MAX_DRAIN)
        self.pulses.setsockopt(zmq.MAXMSGSIZE, 4096)
        self.pulse_address = f"{bind}:{self.pulses.bind_to_random_port(bind)}"
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self.liveness = liveness  # returns a message when a child process has died
        now = time.monotonic()
        self.last_seen = {r: now for r in self.ranks}
        self.promised = {r: heartbeat_s for r in self.ranks}  # rank -> its next heartbeat's
        # delay, as it said last
        self.step = 0
        self.dead: str | None = None
        self.processes: dict[int, tuple[str, int]] = {}  # rank -> (host, pid), from hello
        self.kv_blocks = 0  # the KV pool's blocks, from ready (await_ready)
        self.shares_blocks = False  # every model reads through block tables
        self.failures: dict[int, str] = {}  # rank -> the error it reported
        self.usage_failures: set[int] = set()  # ... of kind "usage" (the config's)
        self._failed_at: float | None = None
        self._inbox: collections.deque[WorkerMessage] = collections.deque()  # not yet used
        self._drops, self._drop_logged = 0, -DROP_LOG_S  # dropped frames
        self.dropped_total = 0  # every frame dropped (the metric reads it)
        self._poller = zmq.Poller()  # the socket and the local workers' pidfds
        self._poller.register(self.sock, zmq.POLLIN)
        self._watch = ProcessWatch(self._poller)  # the workers on this host
        self._pulse_lock = threading.Lock()  # the pulse socket: two threads read it
        self._pulses_read = now
        self.beacon = Beacon(context, bind, heartbeat_s, self.key, after_beat=self._on_beat)

    # --- low level -----------------------------------------------------------------------
    def send(self, rank: int, msg: Message) -> None:
        try:
            self.sock.send_multipart([f"w{rank}".encode(), protocol.encode(msg, self.key)])
        except zmq.ZMQError as exc:
            self._die(f"rank {rank} unreachable: {exc}")

    def send_all(self, msg: Message) -> None:
        for rank in self.ranks:
            self.send(rank, msg)

    def _die(self, reason: str) -> None:
        if self.dead is None:
            self.dead = reason
        raise EngineDeadError(self.dead)

    def _decode(self, parts: list[bytes], what: str) -> WorkerMessage | None:
        """The valid worker message of a ROUTER frame (identity, message), else None
        (dropped and logged as `what`)."""
        if len(parts) != 2:
            self._dropped(f"{what} with {len(parts)} parts")
            return None
        try:
            msg = protocol.decode(parts[1], self.key)
        except protocol.ProtocolError as exc:
            self._dropped(f"{what}: {exc}")
            return None
        if not isinstance(msg, WorkerMessage):
            self._dropped(f"{what}: a {msg.NAME!r} message is no worker's")
            return None
        return msg

    def _read(self) -> WorkerMessage | None:
        """Receive one frame (one must be waiting): the valid message in it, else None.
        Any message marks its sender seen; records any error it reports."""
        msg = self._decode(self.sock.recv_multipart(), "a worker frame")
        if msg is None:
            return None
        if msg.rank in self.last_seen:
            self.last_seen[msg.rank] = time.monotonic()
        if isinstance(msg, Error):
            self._worker_failed(msg.rank, msg.message)
            if msg.kind == "usage":
                self.usage_failures.add(msg.rank)
        return msg

    def _dropped(self, what: str) -> None:
        """Log a dropped frame: the first at once, then at most one line per
        DROP_LOG_S with the count (a local process could flood us with forgeries)."""
        self._drops += 1
        self.dropped_total += 1
        now = time.monotonic()
        if now - self._drop_logged >= DROP_LOG_S:
            more = f" (and {self._drops - 1} more since the last report)" if self._drops > 1 else ""
            log.warning("dropped %s%s", what, more)
            self._drops, self._drop_logged = 0, now

    def _drain(self) -> None:
        """Read every frame already queued: the pulse socket's heartbeats count before ages
        are judged (after a stall of this process, live ranks' beats are waiting there), and
        the control socket's messages mark their senders seen and wait in the inbox. At most
        MAX_DRAIN frames each, so that a flood cannot keep us here."""
        self._drain_pulses()
        for _ in range(MAX_DRAIN):
            if not self.sock.poll(0):
                return
            msg = self._read()
            if msg is not None:
                self._inbox.append(msg)

    def _on_beat(self) -> None:
        """The Beacon's turn: read the heartbeats every PULSE_READ_SHARE of dead_after_s
        (between commands nothing else reads them; each look costs an idle process more
        than its wake-up), so an idle pool notices silence that much late at most."""
        if time.monotonic() - self._pulses_read >= PULSE_READ_SHARE * self.dead_after_s:
            self._drain_pulses()

    def _drain_pulses(self) -> None:
        """The heartbeats that came to the pulse socket since the last look (at most
        MAX_DRAIN): each marks its rank seen now. On the main thread and the Beacon's."""
        with self._pulse_lock:
            self._pulses_read = time.monotonic()
            self._read_pulses()

    def _read_pulses(self) -> None:
        for _ in range(MAX_DRAIN):
            try:
                parts = self.pulses.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self._decode(parts, "a heartbeat frame")
            if msg is None:
                continue
            if not isinstance(msg, Heartbeat):
                self._dropped("a frame on the heartbeat socket that is no heartbeat")
            elif msg.rank in self.last_seen:
                self.last_seen[msg.rank] = time.monotonic()
                # when it says its next one comes (an idle worker beats less often:
                # runtime.control.heartbeat.pace), within a period .. dead_after_s
                next_s = self.heartbeat_s if msg.next_s is None else msg.next_s
                self.promised[msg.rank] = min(max(next_s, self.heartbeat_s), self.dead_after_s)

    def _poll_one(self, timeout_ms: int) -> WorkerMessage | None:
        if self._inbox:
            return self._inbox.popleft()
        if not self._poll(timeout_ms):
            return None
        return self._read()

    def _poll(self, timeout_ms: int) -> bool:
        """Wait up to timeout_ms for a frame; True when one is waiting. A local worker whose
        process ends meanwhile wakes us too, and is noted for check_alive."""
        ready = dict(self._poller.poll(timeout_ms))
        self._watch.collect(ready)
        return self.sock in ready

    def _worker_failed(self, rank: int, message: str) -> None:
        """A rank reported an error: check_alive (next, once the queue is drained) dies
        naming the rank that caused it if one is gone, else gives the cause
        ATTRIBUTION_GRACE_S to show."""
        log.info("rank %s reported an error: %s", rank, message)  # reported by _die
        self.failures.setdefault(rank, message)
        if self._failed_at is None:
            self._failed_at = time.monotonic()

    def usage_error(self) -> str | None:
        """When every failure a rank reported is a problem of the config (kind "usage":
        e.g. a KV cache over its budget), the first of them; else None (a crash)."""
        if not self.failures or set(self.failures) != self.usage_failures:
            return None
        return next(iter(self.failures.values()))

    def _failure_summary(self) -> str:
        first = next(iter(self.failures.values()))
        more = len(self.failures) - 1
        return first + (f" (and {more} more rank(s) failed)" if more else "")

    def _gone(self, exclude: Collection[int] = ()) -> str | None:
        """Why a rank not in `exclude` is gone: a child process that exited (liveness), a
        rank on this host whose process no longer runs, or one whose heartbeats stopped a
        few periods ago (stopped or hung). None if all look alive. Only used to name the
        cause of a failure, never to declare one."""
        if self.liveness is not None:
            reason = self.liveness(exclude=exclude)
            if reason:
                return reason
        host = socket.gethostname()
        for rank, (where, pid) in sorted(self.processes.items()):
            if rank not in exclude and where == host and not _process_runs(pid):
                reason = self._exit_status(rank)
                return reason or f"rank {rank} (pid {pid}) died"
        now = time.monotonic()
        for rank, seen in sorted(self.last_seen.items()):
            if rank not in exclude and now - seen > max(2 * self.promised[rank], 1.5):
                return f"rank {rank} sent no heartbeat for {now - seen:.0f} s"
        return None

    def _exit_status(self, rank: int, wait_s: float = 0.5) -> str | None:
        """How our child `rank` ended (signal or exit code), once it can be reaped: the
        kernel may still be tearing it down, or another thread may hold its wait lock."""
        if self.liveness is None:
            return None
        deadline = time.monotonic() + wait_s
        while True:
            reason = self.liveness(exclude=set(self.ranks) - {rank})
            if reason or time.monotonic() > deadline:
                return reason
            time.sleep(0.01)

    def check_alive(self) -> None:
        """Raise EngineDeadError if a rank died, failed or went silent."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        self._drain()
        if self.liveness is not None:
            reason = self.liveness(exclude=self.failures)
            if reason:
                self._die(f"{reason}; {self._failure_summary()}" if self.failures else reason)
        if self._watch.ended:
            self._local_worker_ended()
        if self._failed_at is not None:
            cause = self._gone(exclude=self.failures)
            if cause:
                self._die(f"{cause}; {self._failure_summary()}")
            if time.monotonic() - self._failed_at > ATTRIBUTION_GRACE_S:
                self._die(self._failure_summary())
        now = time.monotonic()
        for rank, seen in self.last_seen.items():
            if now - seen > self.dead_after_s:
                self._die(f"rank {rank} sent no heartbeat for {now - seen:.0f} s")

    def _local_worker_ended(self) -> None:
        """A local worker's process ended: name it (or the rank that caused a reported
        failure), with its exit status when it is our child."""
        cause = self._gone(exclude=self.failures)
        if self.failures:
            self._die(f"{cause}; {self._failure_summary()}" if cause else self._failure_summary())
        rank, pid, _ = self._watch.ended[0]
        self._die(cause or f"rank {rank} (pid {pid}) exited")

    def wait_for(
        self,
        kind: type[W],
        timeout_s: float,
        step: int | None = None,
        watch: Watch | None = None,
    ) -> dict[int, W]:
        """Collect one `kind` message from every worker (matching `step` if given). `watch`
        sees every message meanwhile (e.g. the workers' startup progress, see
        runtime.control.progress), and None after each quiet poll of 100 ms."""
        got: dict[int, W] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < len(self.ranks):
            self.check_alive()
            if time.monotonic() > deadline:
                missing = sorted(set(self.ranks) - set(got))
                cause = self._gone()
                self._die(
                    (f"{cause}; " if cause else "")
                    + f"ranks {missing} did not answer {kind.NAME!r} within {timeout_s:.0f} s"
                )
            msg = self._poll_one(100)
            if watch is not None:
                watch(msg)
            if not isinstance(msg, kind):
                continue
            if step is not None and getattr(msg, "step", None) != step:
                continue
            got[msg.rank] = msg
        return got

    # --- high level ----------------------------------------------------------------------
    def handshake(self, config: dict, timeout_s: float) -> None:
        hellos = self.wait_for(Hello, timeout_s)
        self.processes = {rank: (m.host, m.pid) for rank, m in hellos.items()}
        for rank, (host, pid) in sorted(self.processes.items()):
            self._watch.add(rank, host, pid)
        self.send_all(Init(config, self.beacon.address, self.pulse_address))

    def await_ready(self, timeout_s: float, watch: Watch | None = None) -> None:
        """Every worker's ready, with the KV pool they agreed on (the same number of blocks
        on every rank: runtime.worker.loading) and whether all their models share blocks."""
        readies = self.wait_for(Ready, timeout_s, watch=watch).values()
        self.kv_blocks = min(m.kv_blocks for m in readies)
        self.shares_blocks = all(m.shares_blocks for m in readies)

    def command(self, cmd: Command, timeout_s: float) -> dict[int, Reply]:
        """Run one step on every worker; returns each rank's reply (a release's StepAck, a
        round's or a prefill's RoundReply: checked where it was decoded)."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        self.step += 1
        self.beacon.active_at = time.monotonic()  # beats at the working pace from its next
        self.send_all(dataclasses.replace(cmd, step=self.step))
        done = self.wait_for(Done, timeout_s, step=self.step)
        return {rank: m.result for rank, m in done.items()}

    def idle(self, timeout_ms: int = 50, wake: Collection = ()) -> list:
        """Between steps: wait up to timeout_ms for a worker's frame, a local worker's end,
        or one of `wake` (sockets or file descriptors: the server's clients) to be readable;
        drain the queue (stale replies are dropped), notice failures. Returns the items of
        `wake` that are readable. An idle server blocks here, so waking for each of these is
        what keeps its detection times; while a reported failure waits for its cause
        (ATTRIBUTION_GRACE_S), the wait is at most 50 ms."""
        if self._failed_at is not None:
            timeout_ms = min(timeout_ms, 50)
        # ... and no longer than until a heartbeat could be too old (the Beacon's thread keeps
        # the ages fresh meanwhile)
        oldest = min(self.last_seen.values(), default=time.monotonic())
        timeout_ms = max(
            1, min(timeout_ms, int(1000 * (oldest + self.dead_after_s - time.monotonic())) + 1)
        )
        ready: dict = {}
        if not self._inbox:
            for item in wake:
                self._poller.register(item, zmq.POLLIN)
            try:
                ready = dict(self._poller.poll(timeout_ms))
            finally:
                for item in wake:
                    self._poller.unregister(item)
            self._watch.collect(ready)
            if self.sock in ready:
                self._read()
        self.check_alive()
        self._inbox.clear()
        return [item for item in wake if item in ready]

    def shutdown(self) -> None:
        for rank in self.ranks:
            try:
                frame = protocol.encode(Shutdown(), self.key)
                self.sock.send_multipart([f"w{rank}".encode(), frame], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def close(self) -> None:
        self._watch.close()
        self.beacon.stop()
        self.pulses.close(0)
        self.sock.close(0)


def _process_runs(pid: int) -> bool:
    """Whether process `pid` of this host is running (not gone, not a zombie)."""
    fields = proc_stat(pid)
    if not fields:
        return not os.path.isdir("/proc/self")  # no procfs: cannot tell, assume it runs
    return fields[0] not in ("Z", "X", "x")
