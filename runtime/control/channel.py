"""The worker pool's sockets: the orchestrator's end of the control channel.

One ROUTER socket; every worker connects a DEALER (identity b"w<rank>"). Each worker's Pulse
thread sends its heartbeats to a second ROUTER, which nobody waits on: the Beacon's thread
reads what came every quarter of the silence limit, and the pool before it judges heartbeat
ages (WorkerPool.check_alive). Every frame read is checked (runtime.control.protocol); one
that is no valid worker message is dropped and logged, a few lines at most.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import zmq

from runtime.control import auth, protocol
from runtime.control.attribution import Attribution, Liveness
from runtime.control.procwatch import ProcessWatch
from runtime.control.protocol import Error, Heartbeat, Message, WorkerMessage

log = logging.getLogger("tandem.pool")

MAX_DRAIN = 10000  # frames read per drain (the socket's receive high-water mark)
DROP_LOG_S = 5.0  # at most one warning about dropped frames per this many seconds
PULSE_READ_SHARE = 0.25  # an idle pool reads the heartbeats every this share of dead_after_s


class Channel(Attribution):
    """Frames to the workers and from them: every message read marks its sender seen, and an
    error it reports is recorded (Attribution); what is not used yet waits in the inbox."""

    def __init__(
        self,
        worker_ranks: tuple[int, ...],
        context: zmq.Context,
        bind: str,
        heartbeat_s: float,
        dead_after_s: float,
        liveness: Liveness | None,
        key: bytes | None,
    ):
        super().__init__(worker_ranks, heartbeat_s, dead_after_s, liveness)
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
        self._inbox: collections.deque[WorkerMessage] = collections.deque()  # not yet used
        self._drops, self._drop_logged = 0, -DROP_LOG_S  # dropped frames
        self.dropped_total = 0  # every frame dropped (the metric reads it)
        self._poller = zmq.Poller()  # the socket and the local workers' pidfds
        self._poller.register(self.sock, zmq.POLLIN)
        self._watch = ProcessWatch(self._poller)  # the workers on this host
        self._pulse_lock = threading.Lock()  # the pulse socket: two threads read it
        self._pulses_read = time.monotonic()

    def send(self, rank: int, msg: Message) -> None:
        try:
            self.sock.send_multipart([f"w{rank}".encode(), protocol.encode(msg, self.key)])
        except zmq.ZMQError as exc:
            self._die(f"rank {rank} unreachable: {exc}")

    def send_all(self, msg: Message) -> None:
        for rank in self.ranks:
            self.send(rank, msg)

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
