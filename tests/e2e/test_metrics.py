"""Prometheus metrics of a running `tandem serve`: scraped at GET /metrics of the HTTP front
(relayed from the server over ZeroMQ) and of `--metrics` (served by the server process
itself), parsed with prometheus_client's parser; the counters must move by exactly what the
requests' outputs report."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime import Client
from tests import launch

pytestmark = pytest.mark.timeout(180)
P = "tandem:"
DRAFT_LEN = 3


def parse(text: str) -> dict:
    """{(sample name, sorted labels): value} of one exposition."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(url: str) -> tuple[dict, str]:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return parse(resp.read().decode()), resp.headers["Content-Type"]


def value(values: dict, name: str, **labels) -> float:
    return values[(P + name, tuple(sorted(labels.items())))]


def delta(before: dict, after: dict, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


@pytest.fixture(scope="module")
def served(tokenized_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics")
    cfg = launch.write_config(
        root / "c.yaml", *tokenized_pair, draft_len=DRAFT_LEN, max_seq_len=200
    )
    address = f"ipc://{root}/server.sock"
    http_port, metrics_port = launch.free_port(), launch.free_port()
    log_path = root / "serve.log"
    proc = launch.start_serve(
        cfg,
        address,
        "--http",
        f"127.0.0.1:{http_port}",
        "--metrics",
        f"127.0.0.1:{metrics_port}",
        log_path=log_path,
    )
    try:
        launch.wait_http(f"http://127.0.0.1:{http_port}/v1", proc, log_path)
        client = Client(address)
        yield {
            "client": client,
            "front": f"http://127.0.0.1:{http_port}/metrics",
            "endpoint": f"http://127.0.0.1:{metrics_port}/metrics",
            "log": log_path,
        }
        client.close()
        assert launch.stop(proc) == 0, open(log_path).read()[-4000:]
    finally:
        if proc.poll() is None:
            launch.stop(proc)
        launch.assert_group_gone(proc.pid)


def serve_mixed(client: Client) -> list:
    """Outputs of a batch that ends on max_new_tokens, a request that ends on a stop string
    and a sampled one."""
    outs = client.generate(
        prompt_token_ids=[[5, 6, 7, 8], [9, 10], [11, 12, 13]], max_new_tokens=12, temperature=0
    )
    full = client.generate("Numbers:", max_new_tokens=30, temperature=0)
    stop_at = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert stop_at.strip(), full.text
    stopped = client.generate("Numbers:", max_new_tokens=30, temperature=0, stop=[stop_at])
    assert stopped.finish_reason == "stop"
    sampled = client.generate("Once upon a time", max_new_tokens=20, temperature=0.8, seed=3)
    return [*outs, full, stopped, sampled]


def test_counters_move_by_exactly_what_was_served(served):
    before, content_type = scrape(served["front"])
    assert content_type.startswith("text/plain; version=0.0.4")
    outs = serve_mixed(served["client"])
    after, _ = scrape(served["front"])
    stats = [o.stats for o in outs]
    assert delta(before, after, "prompt_tokens_total") == sum(s["prompt_tokens"] for s in stats)
    assert delta(before, after, "generation_tokens_total") == sum(len(o.token_ids) for o in outs)
    per_pos = [sum(s["accepted_per_position"][i] for s in stats) for i in range(DRAFT_LEN)]
    assert [
        delta(before, after, "spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
        for i in range(DRAFT_LEN)
    ] == per_pos
    assert delta(before, after, "spec_decode_num_accepted_tokens_total") == sum(per_pos) > 0
    drafting = sum(s["rounds"] - s["target_only_rounds"] for s in stats)
    assert delta(before, after, "spec_decode_num_drafts_total") == drafting
    assert delta(before, after, "spec_decode_num_draft_tokens_total") == DRAFT_LEN * drafting
    assert delta(before, after, "spec_decode_num_target_only_rounds_total") == sum(
        s["target_only_rounds"] for s in stats
    )
    for reason in ("length", "stop"):
        assert delta(before, after, "request_success_total", finished_reason=reason) == sum(
            o.finish_reason == reason for o in outs
        )
    assert value(after, "spec_decode_draft_len") == DRAFT_LEN
    assert value(after, "num_requests_running") == value(after, "num_requests_waiting") == 0


def test_histograms_observe_every_request(served):
    before, _ = scrape(served["endpoint"])
    outs = serve_mixed(served["client"])
    after, _ = scrape(served["endpoint"])
    stats = [o.stats for o in outs]
    n = len(outs)
    assert delta(before, after, "time_to_first_token_seconds_count") == n
    assert delta(before, after, "time_to_first_token_seconds_sum") == pytest.approx(
        sum(s["time_to_first_token_s"] for s in stats), rel=1e-6
    )
    assert delta(before, after, "e2e_request_latency_seconds_count") == n
    # tokens_per_s = tokens / (end - arrival): the same end-to-end time
    assert delta(before, after, "e2e_request_latency_seconds_sum") == pytest.approx(
        sum(len(o.token_ids) / o.stats["tokens_per_s"] for o in outs), rel=1e-6
    )
    # one observation per token after each request's first delivery
    itl = delta(before, after, "inter_token_latency_seconds_count")
    assert 0 < itl <= sum(len(o.token_ids) for o in outs) - n
    assert delta(before, after, "inter_token_latency_seconds_sum") > 0
    rounds = delta(before, after, "round_duration_seconds_count")
    assert max(s["rounds"] for s in stats) <= rounds <= sum(s["rounds"] for s in stats)
    assert delta(before, after, "round_duration_seconds_bucket", le="+Inf") == rounds


def test_both_endpoints_expose_the_same_registry(served):
    served["client"].generate(prompt_token_ids=[1, 2, 3], max_new_tokens=4)
    front, _ = scrape(served["front"])
    endpoint, content_type = scrape(served["endpoint"])
    relayed = parse(served["client"].metrics())
    assert content_type.startswith("text/plain")
    assert front == endpoint == relayed  # idle between the scrapes: nothing moved
    assert any(name.startswith(P + "spec_decode") for name, _ in front)


def test_running_gauge_and_cancelled_requests(served):
    client = served["client"]
    before = parse(client.metrics())
    stream = client.stream("Long story:", max_new_tokens=180, temperature=0)
    next(stream)
    during = parse(client.metrics())
    assert value(during, "num_requests_running") == 1
    stream.close()  # cancels the request on the server
    deadline = time.monotonic() + 10
    while value(now := parse(client.metrics()), "num_requests_running") != 0:
        assert time.monotonic() < deadline, "the cancelled request still runs"
        time.sleep(0.05)
    assert delta(before, now, "request_success_total", finished_reason="cancelled") == 1
    assert delta(before, now, "e2e_request_latency_seconds_count") == 1


@pytest.mark.parametrize(
    "flag,message",
    [
        ("0.0.0.0:9100", "--metrics-allow-remote"),
        ("taken", "--metrics: cannot listen"),
    ],
)
def test_bad_metrics_address_is_a_usage_error(tokenized_pair, tmp_path, flag, message):
    cfg = launch.write_config(tmp_path / "c.yaml", *tokenized_pair)
    with taken_port() as port:
        address = f"127.0.0.1:{port}" if flag == "taken" else flag
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "launcher",
                "serve",
                cfg,
                "--address",
                f"ipc://{tmp_path}/s.sock",
                "--metrics",
                address,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=launch.clean_env(),
        )
    assert res.returncode == 2, res.stderr[-2000:]
    assert message in res.stderr


@contextlib.contextmanager
def taken_port():
    """The port of a loopback socket that listens for the block."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield sock.getsockname()[1]
