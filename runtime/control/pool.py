"""The orchestrator's side of the worker control plane.

`command` sends one step to every worker and waits for all of them, watching heartbeats and
child processes so that a dead or silent rank becomes EngineDeadError. The sockets, and how
the heartbeats are read while the orchestrator idles, are runtime.control.channel's; which
rank a failure is blamed on (the one that died without a word, not the peer that reported an
error), runtime.control.attribution's. The Beacon tells workers that the orchestrator lives.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection
from typing import TypeVar

import zmq

from runtime.control import protocol
from runtime.control.attribution import Liveness
from runtime.control.channel import Channel
from runtime.control.commands import Command, Reply
from runtime.control.heartbeat import Beacon
from runtime.control.protocol import Done, Hello, Init, Ready, Shutdown, WorkerMessage
from runtime.errors import EngineDeadError

# After a rank reports an error, wait at most this long for the process that caused it
# (a peer that died without a word) to show up before reporting the error as it is.
ATTRIBUTION_GRACE_S = 0.5

Watch = Callable[[WorkerMessage | None], None]  # sees every message while the pool waits
W = TypeVar("W", bound=WorkerMessage)


class WorkerPool(Channel):
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
        super().__init__(worker_ranks, context, bind, heartbeat_s, dead_after_s, liveness, key)
        self.step = 0
        self.kv_blocks = 0  # the KV pool's blocks, from ready (await_ready)
        self.shares_blocks = False  # every model reads through block tables
        self.beacon = Beacon(context, bind, heartbeat_s, self.key, after_beat=self._on_beat)

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
