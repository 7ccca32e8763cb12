"""The heartbeat threads end quietly when their process tears the ZeroMQ context down under
them (an error exit does not wait for them): no exception reaches threading.excepthook, so no
traceback is printed beside the one error line."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from runtime.control.heartbeat import Beacon, Pulse

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def thread_errors(monkeypatch):
    errors = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    return errors


def test_beacon_and_pulse_end_quietly_when_the_context_is_terminated(thread_errors):
    context = zmq.Context()
    beacon = Beacon(context, "tcp://127.0.0.1", period_s=0.005)
    control = context.socket(zmq.ROUTER)
    port = control.bind_to_random_port("tcp://127.0.0.1")
    pulse = Pulse(context, 1, f"tcp://127.0.0.1:{port}", beacon.address, period_s=0.005)
    time.sleep(0.1)  # both threads beating
    assert pulse.orchestrator_silent_s < 1.0
    control.close(0)
    context.term()  # returns once both threads closed their sockets
    for thread in (beacon._thread, pulse._thread):
        thread.join(10)
        assert not thread.is_alive()
    assert thread_errors == []


def test_an_idle_pulse_beats_less_often_and_says_so():
    """A Pulse whose worker had no step for two periods sends its heartbeats every 2.5
    periods, each saying when the next comes (next_s); a step (active_at) brings the
    working pace back."""
    from runtime.control import protocol
    from runtime.control.heartbeat import IDLE_PERIODS, pace

    period = 0.04
    assert pace(period, time.monotonic()) == period
    assert pace(period, time.monotonic() - 3 * period) == IDLE_PERIODS * period
    context = zmq.Context()
    beacon = Beacon(context, "tcp://127.0.0.1", period_s=period)
    control = context.socket(zmq.ROUTER)
    port = control.bind_to_random_port("tcp://127.0.0.1")
    pulse = Pulse(context, 1, f"tcp://127.0.0.1:{port}", beacon.address, period_s=period)
    try:

        def heartbeats(seconds: float) -> list[float]:
            got, end = [], time.monotonic() + seconds
            while time.monotonic() < end:
                if control.poll(10):
                    got.append(protocol.decode(control.recv_multipart()[-1]).next_s)
            return got

        time.sleep(4 * period)  # no step since the start: idle now
        while control.poll(0):  # the working-pace heartbeats before
            control.recv_multipart()
        idle = heartbeats(20 * period)
        assert idle and set(idle) == {IDLE_PERIODS * period}, idle
        assert len(idle) <= 20 / IDLE_PERIODS + 1, idle
        pulse.active_at = time.monotonic() + 60  # working from now on
        heartbeats(IDLE_PERIODS * period + 0.05)  # the idle wait in progress ends
        working = heartbeats(20 * period)
        assert working and set(working) == {period}, working
        assert len(working) >= 12, working  # idle, it would be 9 at most
    finally:
        pulse.stop()
        beacon.stop()
        control.close(0)
        context.term()
