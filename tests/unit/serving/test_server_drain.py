"""A drain of the serving loop (runtime.serving.server; SIGTERM's, by
runtime.control.signals.ServerStop): admission closes, pongs and the HTTP front's /health say
so, the requests in flight run to their end, then serving ends; past shutdown_timeout_s the
rest are failed. Driven as test_server_liveness drives the loop: over its client door, with
an orchestrator whose steps sleep and commit a token each. No processes."""

from __future__ import annotations

import signal
import threading
import time

import pytest
from fastapi.testclient import TestClient

from runtime.api.client import Client
from runtime.api.http.app import create_app
from runtime.api.http.backend import HttpClient
from runtime.api.openai.errors import RETRY_AFTER_S
from runtime.control import protocol
from runtime.control.signals import ServerStop
from runtime.errors import EngineDeadError, EngineDrainingError
from tests.unit.serving.test_server_liveness import RawClient, Served

pytestmark = pytest.mark.timeout(60)
STEP_S = 0.02
SLOW_STEP_S = 0.1  # LONG tokens then take 6 s: longer than the drains that run out
LONG = 60  # new tokens (the fake's max_seq_len is 64)


@pytest.fixture
def served(tmp_path):
    made = []

    def make(**kwargs) -> Served:
        made.append(Served(tmp_path, **kwargs))
        return made[-1]

    yield make
    for s in made:
        s.close()


def _generate(client: Client, results: dict, key: str, tokens: int, stream: bool) -> None:
    """On a thread: the request's token ids, or the exception it raised, into results."""
    try:
        if stream:
            deltas = client.stream(prompt_token_ids=[1], max_new_tokens=tokens)
            results[key] = [t for d in deltas for t in d.token_ids]
        else:
            results[key] = client.generate(prompt_token_ids=[1], max_new_tokens=tokens).token_ids
    except Exception as exc:  # noqa: BLE001 - the test reads it
        results[key] = exc


def _in_flight(s: Served, client: Client, tokens: int) -> tuple[dict, list[threading.Thread]]:
    """A streamed and a whole request running on the server (each has a token)."""
    results: dict = {}
    threads = [
        threading.Thread(target=_generate, args=(client, results, key, tokens, key == "stream"))
        for key in ("stream", "whole")
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while not (len(s.orch.seqs) == 2 and all(seq.generated for seq in s.orch.seqs)):
        assert time.monotonic() < deadline, "the requests did not start"
        time.sleep(0.01)
    return results, threads


def _drain(s: Served) -> None:
    """SIGTERM's part (ServerStop sets the event), until the loop has begun the drain: it
    looks at the event once per step."""
    s.drain.set()
    deadline = time.monotonic() + 5
    while s.server.drain_ends is None:
        assert time.monotonic() < deadline, "the drain did not begin"
        time.sleep(0.005)


def test_requests_in_flight_finish_and_new_ones_are_refused(served):
    s = served(step_s=STEP_S, shutdown_timeout_s=30.0)
    with Client(s.address) as client:
        assert "draining" not in client.info()
        results, threads = _in_flight(s, client, tokens=40)
        _drain(s)
        with pytest.raises(EngineDrainingError, match="takes no new requests"):
            client.generate(prompt_token_ids=[1], max_new_tokens=2)
        assert client.info()["draining"] is True  # pongs say it: the HTTP /health reads it
        for t in threads:
            t.join(20)
    assert [len(results[k]) for k in ("stream", "whole")] == [40, 40], results
    s.thread.join(5)
    assert not s.thread.is_alive() and s.error is None  # serving ended with the last one
    assert s.orch.cancelled == []


def test_a_raw_clients_new_request_is_failed_draining(served):
    s = served(step_s=STEP_S, shutdown_timeout_s=30.0)
    with Client(s.address) as client:
        _, threads = _in_flight(s, client, tokens=40)
        _drain(s)
        raw = RawClient(s.address)
        try:
            raw.generate("late")
            reply = raw.replies(5.0)[-1]
        finally:
            raw.close()
        assert isinstance(reply, protocol.Failed) and reply.kind == "draining", reply
        for t in threads:
            t.join(20)


def test_the_rest_fail_when_the_drain_runs_out(served):
    s = served(step_s=SLOW_STEP_S, shutdown_timeout_s=0.5)
    with Client(s.address) as client:
        results, threads = _in_flight(s, client, tokens=LONG)
        start = time.monotonic()
        s.drain.set()
        for t in threads:
            t.join(10)
        took = time.monotonic() - start
    assert 0.4 < took < 5.0, took
    for key in ("stream", "whole"):
        assert isinstance(results[key], EngineDeadError), results
        assert "server.shutdown_timeout_s" in str(results[key]), results[key]
        assert not isinstance(results[key], EngineDrainingError)
    s.thread.join(5)
    assert not s.thread.is_alive() and s.error is None


def test_a_stop_during_the_drain_ends_it_at_once(served):
    s = served(step_s=SLOW_STEP_S, shutdown_timeout_s=30.0)
    with Client(s.address) as client:
        results, threads = _in_flight(s, client, tokens=LONG)
        s.drain.set()
        time.sleep(0.2)
        start = time.monotonic()
        s.stop.set()  # SIGINT, or a second SIGTERM
        for t in threads:
            t.join(10)
        assert time.monotonic() - start < 3.0
    for key in ("stream", "whole"):
        assert isinstance(results[key], EngineDeadError), results
        assert str(results[key]) == "server shutting down"


def test_an_idle_server_ends_its_drain_at_once(served):
    s = served(step_s=STEP_S, shutdown_timeout_s=30.0)
    with Client(s.address) as client:
        client.info()
    start = time.monotonic()
    s.drain.set()
    s.thread.join(5)
    assert not s.thread.is_alive() and time.monotonic() - start < 1.0  # idle waits are 0.1 s
    assert s.error is None


# --- the HTTP front during a drain ----------------------------------------------------------
def test_health_and_new_http_requests_answer_503_while_draining(served):
    s = served(step_s=STEP_S, shutdown_timeout_s=30.0)
    http_client = HttpClient(s.address)
    try:
        with TestClient(create_app(http_client, "fake")) as http, Client(s.address) as client:
            assert http.get("/health").status_code == 200
            _, threads = _in_flight(s, client, tokens=LONG)
            _drain(s)
            health = http.get("/health")
            body = {"model": "fake", "prompt": [1, 2], "max_tokens": 2}
            late = http.post("/v1/completions", json=body)
            for t in threads:
                t.join(20)
    finally:
        http_client.close()
    assert health.status_code == 503, health.text
    assert health.json()["error"]["code"] == "server_draining"
    assert late.status_code == 503, late.text
    assert late.headers["Retry-After"] == str(RETRY_AFTER_S)
    error = late.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "server_draining", error
    assert "takes no new requests" in error["message"]


def test_health_is_503_when_the_server_does_not_answer(tmp_path):
    http_client = HttpClient(f"ipc://{tmp_path}/nobody.sock", connect_timeout_s=0.3)
    try:
        with TestClient(create_app(http_client, "fake")) as http:
            resp = http.get("/health")
    finally:
        http_client.close()
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_dead", resp.text


# --- which signal asks for what -------------------------------------------------------------
def test_the_first_sigterm_drains_and_a_second_signal_stops():
    stop = ServerStop(drains=True)
    stop.on_signal(signal.SIGTERM)
    assert stop.drain.is_set() and not stop.now.is_set()
    stop.on_signal(signal.SIGTERM)
    assert stop.now.is_set()


@pytest.mark.parametrize("drains", [True, False])
def test_sigint_or_a_sigterm_without_a_drain_stops_at_once(drains):
    stop = ServerStop(drains=drains)
    stop.on_signal(signal.SIGINT if drains else signal.SIGTERM)
    assert stop.now.is_set() and not stop.drain.is_set()
