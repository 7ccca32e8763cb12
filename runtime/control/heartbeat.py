"""Liveness in both directions, on threads of their own so that a long forward pass or a
busy orchestrator never looks like a dead process.

- The orchestrator's Beacon publishes a beat on a PUB socket every period.
- Each worker's Pulse sends a heartbeat message to the orchestrator's pulse socket every
  period and listens to the Beacon; `orchestrator_silent_s` tells the worker loop how long
  the orchestrator has been quiet.

Both threads sleep a whole period between turns (an Event wait, ended early by stop()), and
a process that has had no work for IDLE_AFTER_PERIODS periods (`active_at`, set by its main
thread) beats only every IDLE_PERIODS periods: a quarter of the 10-period limits that judge
silence, which so still see a live peer at most half of them old. Each heartbeat says when
the next one comes (`next_s`), so the pool's finer judgement (naming the rank that caused a
failure) allows for the slower pace. On a virtual machine each wake-up from a long sleep
costs milliseconds of CPU (tests/e2e/test_idle.py), so a wake-up saved counts.

The Pulse takes the beats that came meanwhile at each turn, so `orchestrator_silent_s` may
run up to a turn late, which its users' limits allow for; the Beacon's turn also reads the
workers' heartbeats for the pool (`after_beat`), so that an idle orchestrator's main thread
need not wake for them.
"""

from __future__ import annotations

import hmac
import threading
import time
from collections.abc import Callable

import zmq

from runtime.control import auth, protocol

# errors of a socket whose context was terminated while its thread ran (an error exit tears
# the process down without waiting for the heartbeat threads): end the thread quietly
_ENDING = (zmq.ETERM, zmq.ENOTSOCK)
IDLE_AFTER_PERIODS = 2.0  # no work for this many periods: the process is idle
IDLE_PERIODS = 2.5  # ... and beats every this many periods


def pace(period_s: float, active_at: float) -> float:
    """Seconds to the next beat: a period while the process works, IDLE_PERIODS of them once
    it has been idle (no work since `active_at`) for IDLE_AFTER_PERIODS."""
    idle = time.monotonic() - active_at > IDLE_AFTER_PERIODS * period_s
    return period_s * (IDLE_PERIODS if idle else 1.0)


class Beacon:
    def __init__(
        self,
        context: zmq.Context,
        bind: str,
        period_s: float,
        key: bytes | None = None,
        after_beat: Callable[[], None] | None = None,
    ):
        self.period_s = period_s
        self.beat = auth.sign(b"beat", key)
        self._after_beat = after_beat  # run on this thread after each beat (the pool's
        # look at the workers' heartbeats)
        self.active_at = time.monotonic()  # the orchestrator's last work (set by the pool)
        self._stop = threading.Event()
        self._bound = threading.Event()
        self.address = ""
        self._context = context
        self._thread = threading.Thread(target=self._run, args=(bind,), name="beacon", daemon=True)
        self._thread.start()
        self._bound.wait(10)

    def _run(self, bind: str) -> None:
        sock = self._context.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)
        port = sock.bind_to_random_port(bind)
        self.address = f"{bind}:{port}"
        self._bound.set()
        try:
            while not self._stop.wait(pace(self.period_s, self.active_at)):
                try:
                    sock.send(self.beat, zmq.NOBLOCK)
                except zmq.Again:
                    pass
                if self._after_beat is not None:
                    self._after_beat()
        except zmq.ZMQError as e:  # the context terminated under us: the process is ending
            if e.errno not in _ENDING:
                raise
        finally:
            sock.close(0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


class Pulse:
    def __init__(self, context: zmq.Context, rank: int, control: str, beacon: str, period_s: float):
        self.rank = rank
        self.period_s = period_s
        self._last_beat = time.monotonic()
        self.active_at = time.monotonic()  # the worker's last step (set by its main thread)
        self._stop = threading.Event()
        self._context = context
        self._thread = threading.Thread(
            target=self._run, args=(control, beacon), name="pulse", daemon=True
        )
        self._thread.start()

    @property
    def orchestrator_silent_s(self) -> float:
        return time.monotonic() - self._last_beat

    def _run(self, control: str, beacon: str) -> None:
        out = self._context.socket(zmq.DEALER)
        out.setsockopt(zmq.LINGER, 0)
        out.setsockopt(zmq.SNDHWM, 4)
        out.connect(control)
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVHWM, 16)
        sub.connect(beacon)
        key = auth.control_key()
        frames = {}  # next_s -> the encoded heartbeat saying it
        beat = auth.sign(b"beat", key)
        try:
            while True:
                wait_s = pace(self.period_s, self.active_at)
                if wait_s not in frames:
                    frames[wait_s] = protocol.encode(protocol.Heartbeat(self.rank, wait_s), key)
                try:
                    out.send(frames[wait_s], zmq.NOBLOCK)
                except zmq.Again:
                    pass
                if _took_beat(sub, beat):
                    self._last_beat = time.monotonic()
                if self._stop.wait(wait_s):
                    break
        except zmq.ZMQError as e:  # as in Beacon._run
            if e.errno not in _ENDING:
                raise
        finally:
            out.close(0)
            sub.close(0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _took_beat(sub: zmq.Socket, beat: bytes) -> bool:
    """Whether a genuine beat came since the last call (all queued ones are read; forged
    beats don't count)."""
    genuine = False
    while True:
        try:
            got = sub.recv(zmq.NOBLOCK)
        except zmq.Again:
            return genuine
        genuine = genuine or hmac.compare_digest(got, beat)
