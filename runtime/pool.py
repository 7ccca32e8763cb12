"""The orchestrator's side of the worker control plane.

One ROUTER socket; every worker connects a DEALER (identity b"w<rank>") and, from its Pulse
thread, a heartbeat DEALER; the Beacon tells workers that the orchestrator lives. `command` sends one step to every worker and waits for all of them, watching
heartbeats and child processes so that a dead or silent rank becomes EngineDeadError.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import zmq

from runtime import protocol
from runtime.errors import EngineDeadError
from runtime.heartbeat import Beacon

log = logging.getLogger("tandem.pool")


class WorkerPool:
    def __init__(self, worker_ranks: tuple[int, ...], context: zmq.Context,
                 bind: str = "tcp://127.0.0.1", heartbeat_s: float = 1.0,
                 dead_after_s: float = 30.0,
                 liveness: Callable[[], str | None] | None = None):
        self.ranks = tuple(worker_ranks)
        self.sock = context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.SNDHWM, 1000)
        self.sock.setsockopt(zmq.RCVHWM, 10000)
        port = self.sock.bind_to_random_port(bind)
        self.address = f"{bind}:{port}"
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self.liveness = liveness          # returns a message when a child process has died
        now = time.monotonic()
        self.last_seen = {r: now for r in self.ranks}
        self.step = 0
        self.dead: str | None = None
        self.beacon = Beacon(context, bind, heartbeat_s)

    # --- low level -----------------------------------------------------------------------
    def send(self, rank: int, msg: dict) -> None:
        try:
            self.sock.send_multipart([f"w{rank}".encode(), protocol.encode(msg)])
        except zmq.ZMQError as exc:
            self._die(f"rank {rank} unreachable: {exc}")

    def send_all(self, msg: dict) -> None:
        for rank in self.ranks:
            self.send(rank, msg)

    def _die(self, reason: str) -> None:
        if self.dead is None:
            self.dead = reason
        raise EngineDeadError(self.dead)

    def _poll_one(self, timeout_ms: int) -> dict | None:
        if not self.sock.poll(timeout_ms):
            return None
        parts = self.sock.recv_multipart()
        if len(parts) != 2:
            log.warning("dropped a frame with %d parts", len(parts))
            return None
        try:
            msg = protocol.decode(parts[1])
        except protocol.ProtocolError as exc:
            log.warning("dropped a worker frame: %s", exc)
            return None
        rank = msg.get("rank")
        if rank in self.last_seen:
            self.last_seen[rank] = time.monotonic()
        if msg["type"] == "error":
            self._die(msg["message"])
        return msg

    def check_alive(self) -> None:
        """Raise EngineDeadError if a rank died or went silent."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if self.liveness is not None:
            reason = self.liveness()
            if reason:
                self._die(reason)
        now = time.monotonic()
        for rank, seen in self.last_seen.items():
            if now - seen > self.dead_after_s:
                self._die(f"rank {rank} sent no heartbeat for {now - seen:.0f} s")

    def wait_for(self, kind: str, timeout_s: float, step: int | None = None) -> dict[int, dict]:
        """Collect one `kind` message from every worker (matching `step` if given)."""
        got: dict[int, dict] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < len(self.ranks):
            self.check_alive()
            if time.monotonic() > deadline:
                missing = sorted(set(self.ranks) - set(got))
                self._die(f"ranks {missing} did not answer {kind!r} within {timeout_s:.0f} s")
            msg = self._poll_one(100)
            if msg is None or msg["type"] != kind:
                continue
            if step is not None and msg.get("step") != step:
                continue
            got[msg["rank"]] = msg
        return got

    # --- high level ----------------------------------------------------------------------
    def handshake(self, config: dict, timeout_s: float) -> None:
        self.wait_for("hello", timeout_s)
        self.send_all({"type": "init", "config": config, "heartbeat": self.beacon.address})

    def command(self, msg: dict, timeout_s: float) -> dict[int, dict]:
        """Run one step on every worker; returns rank -> result map."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        self.step += 1
        msg = dict(msg, step=self.step)
        self.send_all(msg)
        done = self.wait_for("done", timeout_s, step=self.step)
        return {rank: m["result"] for rank, m in done.items()}

    def idle(self, timeout_ms: int = 50) -> None:
        """Between steps: drain heartbeats, notice failures."""
        self.check_alive()
        while self._poll_one(timeout_ms) is not None:
            timeout_ms = 0

    def shutdown(self) -> None:
        for rank in self.ranks:
            try:
                self.sock.send_multipart([f"w{rank}".encode(),
                                          protocol.encode({"type": "shutdown"})], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def close(self) -> None:
        self.beacon.stop()
        self.sock.close(0)
