"""A worker that got SIGINT/SIGTERM (runtime.worker.control_link.ControlLink): its
orchestrator got it too, and on SIGTERM drains before it sends shutdown, so the worker
serves on for its grace period (SIGNAL_GRACE_S plus, from init on, server.shutdown_timeout_s)
and only past it stops on its own. A ROUTER socket stands in for the orchestrator."""

from __future__ import annotations

import time

import pytest
import zmq

from runtime.control import auth, protocol
from runtime.control.protocol import Shutdown
from runtime.worker.control_link import SIGNAL_GRACE_S, ControlLink, WorkerExit

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def linked():
    """(link, send): a worker's link and a function that sends it a message."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.IDENTITY, b"w1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    link = ControlLink(1, dealer)
    dealer.send(b"hello")  # the router knows the worker once this came: nothing is dropped
    assert router.poll(5000) and router.recv_multipart()[0] == b"w1"

    def send(msg) -> None:
        router.send_multipart([b"w1", protocol.encode(msg, auth.control_key())])

    yield link, send
    dealer.close(0)
    router.close(0)
    context.term()


def test_a_worker_signalled_during_a_drain_still_takes_commands(linked):
    link, send = linked
    link.grace_s = SIGNAL_GRACE_S + 20.0  # as init sets it: server.shutdown_timeout_s 20
    link.signalled_at = time.monotonic() - SIGNAL_GRACE_S - 1  # the drain goes on
    send(Shutdown())
    got = link.recv(5.0)
    assert isinstance(got, Shutdown), got


def test_past_its_grace_a_signalled_worker_stops_on_its_own(linked):
    link, send = linked
    link.signalled_at = time.monotonic() - SIGNAL_GRACE_S - 1  # grace_s: SIGNAL_GRACE_S
    send(Shutdown())
    with pytest.raises(WorkerExit, match="stopped by signal") as info:
        link.recv(5.0)
    assert info.value.code == 0
