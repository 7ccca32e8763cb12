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
    time.sleep(0.1)                              # both threads beating
    assert pulse.orchestrator_silent_s < 1.0
    control.close(0)
    context.term()                               # returns once both threads closed their sockets
    for thread in (beacon._thread, pulse._thread):
        thread.join(10)
        assert not thread.is_alive()
    assert thread_errors == []
