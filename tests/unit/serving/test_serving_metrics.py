"""The Prometheus metrics of runtime/serving/metrics.py + prometheus.py, fed a scripted stream
of scheduler events (the calls the scheduler makes, in its order) and read back through the
text exposition, parsed by prometheus_client's own parser."""

from __future__ import annotations

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime.control.commands import WORKER, RoundReply
from runtime.serving.metrics import ServingMetrics

pytestmark = pytest.mark.timeout(30)
P = "tandem:"


def scrape(metrics: ServingMetrics) -> tuple[dict, dict]:
    """({(sample name, labels): value}, {family name: type}) of one exposition."""
    values, types = {}, {}
    for family in text_string_to_metric_families(metrics.exposition()):
        types[family.name] = family.type
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values, types


def value(values: dict, name: str, **labels) -> float:
    return values[(P + name, tuple(sorted(labels.items())))]


# One scripted request: its prompt length, its rounds as (k, accepted, tokens committed,
# seconds since its previous tokens), how it ends, and its time to first token / end. Round
# i of the batch has one k (round 1 is target-only, two decode steps); EOS cut request 1's
# last round short.
STREAM = [
    {
        "prompt": 5,
        "rounds": [(4, 4, 5, 0.0), (0, 0, 2, 0.02), (4, 0, 1, 0.01)],
        "reason": "length",
        "ttft": 0.03,
        "e2e": 0.2,
    },
    {
        "prompt": 3,
        "rounds": [(4, 2, 3, 0.0), (0, 0, 2, 0.04), (4, 3, 2, 0.03)],
        "reason": "stop",
        "ttft": 0.5,
        "e2e": 1.5,
    },
    {"prompt": 7, "rounds": [(4, 0, 1, 0.0)], "reason": "cancelled", "ttft": 0.01, "e2e": 0.05},
]


def feed(metrics: ServingMetrics, stream: list[dict]) -> None:
    """The events the scheduler sends for `stream`: one prefill of every request, rounds of
    the whole batch (each round's k is the k of its sequences), per sequence what it
    committed, and the ends."""
    metrics.prefill_done(0.1, sum(r["prompt"] for r in stream))
    for i in range(max(len(r["rounds"]) for r in stream)):
        live = [r for r in stream if i < len(r["rounds"])]
        start = metrics.round_begins()
        metrics.round_ends(start, {1: RoundReply(WORKER, 0.001)}, live[0]["rounds"][i][0])
        for request in live:
            k, accepted, tokens, gap = request["rounds"][i]
            if i == 0:
                metrics.first_token(request["ttft"])
            else:
                metrics.delivered(gap, tokens)
            metrics.committed(k, accepted, tokens)
            if i == len(request["rounds"]) - 1:
                metrics.finished(request["reason"], request["e2e"])


def test_counters_sum_the_stream_exactly():
    metrics = ServingMetrics()
    metrics.watch(lambda: 2, lambda: 5, max_draft_len=4)
    feed(metrics, STREAM)
    values, types = scrape(metrics)
    rounds = [r for request in STREAM for r in request["rounds"]]
    assert value(values, "prompt_tokens_total") == 15
    assert value(values, "generation_tokens_total") == sum(r[2] for r in rounds) == 16
    assert value(values, "spec_decode_num_draft_tokens_total") == sum(r[0] for r in rounds)
    assert value(values, "spec_decode_num_accepted_tokens_total") == 9
    assert value(values, "spec_decode_num_drafts_total") == 5
    assert value(values, "spec_decode_num_target_only_rounds_total") == 2
    # position i counts the drafting rounds that kept draft token i: accepted 4, 0, 2, 3, 0
    assert [
        value(values, "spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
        for i in range(4)
    ] == [3, 3, 2, 1]
    for reason, count in (("length", 1), ("stop", 1), ("cancelled", 1)):
        assert value(values, "request_success_total", finished_reason=reason) == count
    assert value(values, "num_requests_running") == 2
    assert value(values, "num_requests_waiting") == 5
    assert value(values, "spec_decode_draft_len") == 4  # the last round's k
    assert types[P + "request_success"] == "counter"
    assert types[P + "num_requests_running"] == "gauge"
    assert types[P + "time_to_first_token_seconds"] == "histogram"


def test_histograms_hold_each_observation():
    metrics = ServingMetrics()
    feed(metrics, STREAM)
    values, _ = scrape(metrics)
    assert value(values, "time_to_first_token_seconds_count") == 3
    assert value(values, "time_to_first_token_seconds_sum") == pytest.approx(0.54)
    assert value(values, "e2e_request_latency_seconds_count") == 3
    assert value(values, "e2e_request_latency_seconds_sum") == pytest.approx(1.75)
    # one observation per token after the first delivery, each gap / tokens delivered
    assert value(values, "inter_token_latency_seconds_count") == 2 + 1 + 2 + 2
    # 0.02 / 2 and 0.01 / 1 lie in the 10 ms bucket, 0.04 / 2 and 0.03 / 2 above it
    assert value(values, "inter_token_latency_seconds_sum") == pytest.approx(
        0.02 + 0.01 + 0.04 + 0.03
    )
    assert value(values, "inter_token_latency_seconds_bucket", le="0.01") == 2 + 1
    assert value(values, "inter_token_latency_seconds_bucket", le="+Inf") == 7
    assert value(values, "round_duration_seconds_count") == 3  # rounds of the batch


def test_cancelled_while_queued_counts_without_a_latency():
    metrics = ServingMetrics()
    metrics.finished("cancelled", None)
    values, _ = scrape(metrics)
    assert value(values, "request_success_total", finished_reason="cancelled") == 1
    assert value(values, "request_success_total", finished_reason="stop") == 0
    assert value(values, "e2e_request_latency_seconds_count") == 0


def test_every_server_has_its_own_registry():
    first, second = ServingMetrics(), ServingMetrics()
    first.committed(4, 2, 3)
    assert value(scrape(first)[0], "generation_tokens_total") == 3
    assert value(scrape(second)[0], "generation_tokens_total") == 0
    global_text = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
    assert P not in global_text
