"""Liveness in both directions, on threads of their own so that a long forward pass or a
busy orchestrator never looks like a dead process.

- The orchestrator's Beacon publishes a beat on a PUB socket every period.
- Each worker's Pulse sends a heartbeat message to the orchestrator's control socket every
  period and listens to the Beacon; `orchestrator_silent_s` tells the worker loop how long
  the orchestrator has been quiet.

Both threads sleep between beats (an Event wait; a poll until the next send, woken by a
beat or by stop()): an idle process wakes a couple of times per period, no more.
"""
from __future__ import annotations

import hmac
import os
import threading
import time

import zmq

from runtime.control import auth, protocol


# errors of a socket whose context was terminated while its thread ran (an error exit tears
# the process down without waiting for the heartbeat threads): end the thread quietly
_ENDING = (zmq.ETERM, zmq.ENOTSOCK)


class Beacon:
    def __init__(self, context: zmq.Context, bind: str, period_s: float,
                 key: bytes | None = None):
        self.period_s = period_s
        self.beat = auth.sign(b"beat", key)
        self._stop = threading.Event()
        self._bound = threading.Event()
        self.address = ""
        self._context = context
        self._thread = threading.Thread(target=self._run, args=(bind,), name="beacon",
                                        daemon=True)
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
            while not self._stop.wait(self.period_s):
                try:
                    sock.send(self.beat, zmq.NOBLOCK)
                except zmq.Again:
                    pass
        except zmq.ZMQError as e:   # the context terminated under us: the process is ending
            if e.errno not in _ENDING:
                raise
        finally:
            sock.close(0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


class Pulse:
    def __init__(self, context: zmq.Context, rank: int, control: str, beacon: str,
                 period_s: float):
        self.rank = rank
        self.period_s = period_s
        self._last_beat = time.monotonic()
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()   # stop() wakes the thread's poll
        self._context = context
        self._thread = threading.Thread(target=self._run, args=(control, beacon),
                                        name="pulse", daemon=True)
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
        sub.connect(beacon)
        key = auth.control_key()
        frame = protocol.encode({"type": "heartbeat", "rank": self.rank}, key)
        beat = auth.sign(b"beat", key)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_send = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_send:
                    next_send = now + self.period_s
                    try:
                        out.send(frame, zmq.NOBLOCK)
                    except zmq.Again:
                        pass
                # until the next send; a beat (noted at once) or stop() ends the wait early
                if sub in dict(poller.poll(max(1, int(1000 * (next_send - now))))):
                    while sub.poll(0):
                        if hmac.compare_digest(sub.recv(), beat):   # forged beats don't count
                            self._last_beat = time.monotonic()
        except zmq.ZMQError as e:   # as in Beacon._run
            if e.errno not in _ENDING:
                raise
        finally:
            out.close(0)
            sub.close(0)

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        os.write(self._wake_w, b"s")
        self._thread.join(5)
        if not self._thread.is_alive():
            os.close(self._wake_r)
            os.close(self._wake_w)
