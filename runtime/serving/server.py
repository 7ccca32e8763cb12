"""The serving loop of rank 0: clients over ZeroMQ (ROUTER) <-> the orchestrator.

An idle server blocks: one poll over the client socket, the workers' control socket, the
local workers' pidfds and a signal wake-up pipe, until a worker's heartbeat could be too old
(the Beacon's thread reads the heartbeats meanwhile: runtime.control.pool), at most
IDLE_WAIT_S. So it uses no CPU to speak of, and still sees a client's frame, a worker's error
or death and a stopping signal at once.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import zmq

from runtime.control import protocol
from runtime.control.signals import SignalWakeup
from runtime.errors import EngineDeadError
from runtime.serving.orchestrator import Orchestrator
from runtime.serving.scheduler import Event

log = logging.getLogger("tandem.server")
CLIENT_TIMEOUT_S = 10.0   # a client with requests in flight pings every second
MAX_FRAMES_PER_TURN = 1000  # client frames handled between two scheduler steps
IDLE_WAIT_S = 10.0        # longest idle wait: `stop` set by a thread, not a signal, is seen
                          # this late (the owner watch of launcher.session signals instead)


@dataclass
class Pending:
    identity: bytes
    stream: bool
    seqs: list


class Server:
    def __init__(self, orch: Orchestrator, address: str, context: zmq.Context,
                 key: bytes | None = None):
        self.orch = orch
        self.key = key          # HMAC key: every frame in and out is signed (runtime.control.auth)
        self.sock = context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 10000)
        self.sock.setsockopt(zmq.RCVHWM, 1000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        self.sock.bind(address)
        self.pending: dict[str, Pending] = {}
        self.client_seen: dict[bytes, float] = {}   # identity -> last frame (clients ping)
        self.client_timeout_s = CLIENT_TIMEOUT_S
        self._last_sweep = time.monotonic()

    def reply(self, identity: bytes, msg: dict) -> None:
        try:
            self.sock.send_multipart([identity, protocol.encode(msg, self.key)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("could not reply to a client: %s", exc)

    def serve(self, stop: threading.Event) -> None:
        """Until `stop` is set. Raises EngineDeadError when the workers are gone."""
        idle_ms = int(1000 * IDLE_WAIT_S)
        with SignalWakeup() as wakeup:
            try:
                while not stop.is_set():
                    self.turn(idle_ms, wakeup)
            except EngineDeadError as exc:
                self.fail_all(str(exc), "dead")
                raise
        self.fail_all("server shutting down", "dead")

    def turn(self, idle_ms: int, wakeup: SignalWakeup) -> None:
        """What has arrived, but a bounded number of frames (clients that keep sending,
        pings or stats, must not starve the rounds); then one round, or, with nothing to
        run, a wait for the next frame, worker event or signal."""
        for _ in range(MAX_FRAMES_PER_TURN):
            if not self.sock.poll(0):
                break
            self.handle_frame(self.sock.recv_multipart())
        if self.orch.has_work:
            self.dispatch(self.orch.step())
        else:
            self.orch.idle(idle_ms, wake=(self.sock, *wakeup.fds))
            wakeup.drain()
        self.sweep_clients()

    def fail_all(self, message: str, kind: str) -> None:
        for rid, pend in list(self.pending.items()):
            self.reply(pend.identity, {"type": "failed", "id": rid, "message": message,
                                       "kind": kind})
        self.pending.clear()

    def handle_frame(self, parts: list[bytes]) -> None:
        if len(parts) != 2:
            log.warning("dropped a client frame with %d parts", len(parts))
            return
        identity, frame = parts
        self.client_seen[identity] = time.monotonic()
        try:
            msg = protocol.decode(frame, self.key)
        except protocol.ProtocolError as exc:
            log.warning("dropped a client frame: %s", exc)
            return
        kind = msg["type"]
        if kind == "ping":
            self.reply(identity, {"type": "pong", "id": msg["id"], "info": self.orch.info()})
        elif kind == "cancel":
            if msg["id"] in self.pending and self.pending[msg["id"]].identity == identity:
                del self.pending[msg["id"]]
                self.orch.cancel(msg["id"])
        elif kind == "stats":
            self.reply(identity, {"type": "stats_reply", "id": msg["id"],
                                  "stats": self.orch.stats()})
        elif kind == "metrics":
            self.reply(identity, {"type": "metrics_reply", "id": msg["id"],
                                  "text": self.orch.metrics_text()})
        elif kind == "generate":
            self.admit(identity, msg)
        else:
            log.warning("dropped a client message of type %r", kind)

    def admit(self, identity: bytes, msg: dict) -> None:
        rid = msg["id"]
        try:
            if rid in self.pending:
                raise ValueError(f"request id {rid!r} is already in use")
            seqs = self.orch.make_sequences(rid, msg.get("prompts"), msg.get("prompt_ids"),
                                            msg["params"], chat=msg.get("chat", False),
                                            messages=msg.get("messages"))
        except (ValueError, TypeError) as exc:
            self.reply(identity, {"type": "failed", "id": rid, "message": str(exc),
                                  "kind": "value"})
            return
        self.pending[rid] = Pending(identity, msg["stream"], seqs)
        self.orch.submit(seqs)

    def dispatch(self, events: list[Event]) -> None:
        for event in events:
            seq = event.seq
            pend = self.pending.get(seq.request_id)
            if pend is None:
                continue
            if event.kind == "delta" and pend.stream and (event.token_ids or event.text):
                self.reply(pend.identity, {"type": "delta", "id": seq.request_id,
                                           "index": seq.index, "token_ids": event.token_ids,
                                           "text": event.text})
            if event.kind == "final" and all(s.finish_reason for s in pend.seqs) and \
                    all(s.t_end is not None for s in pend.seqs):
                del self.pending[seq.request_id]
                self.reply(pend.identity, {"type": "final", "id": seq.request_id,
                                           "outputs": [s.output() for s in pend.seqs]})

    def sweep_clients(self) -> None:
        """Cancel the requests of clients that stopped pinging (gone without a word)."""
        now = time.monotonic()
        if now - self._last_sweep < 1.0:
            return
        self._last_sweep = now
        for rid, pend in list(self.pending.items()):
            if now - self.client_seen.get(pend.identity, now) > self.client_timeout_s:
                log.warning("client gone; cancelling request %s", rid)
                del self.pending[rid]
                self.orch.cancel(rid)
        for identity, seen in list(self.client_seen.items()):
            if now - seen > 10 * self.client_timeout_s:
                del self.client_seen[identity]

    def close(self) -> None:
        self.sock.close(0)
