"""The server's Prometheus metrics: one registry per server (never prometheus_client's global
one, so two servers in one process, or a test beside a server, never share a counter), its
metric objects, and `tandem serve --metrics`'s HTTP endpoint.

Names follow vLLM's (`vllm:` -> `tandem:`). ServingMetrics (runtime/serving/metrics.py) feeds
it from the scheduler's events; the counters are sums of what the requests' outputs report,
so a scrape agrees exactly with `usage` and `stats`:
  prompt_tokens_total                = sum of stats["prompt_tokens"]
  generation_tokens_total            = sum of len(token_ids)
  spec_decode_num_draft_tokens_total = sum over rounds of each sequence's k
  spec_decode_num_accepted_tokens_per_pos_total{position=i}
                                     = sum of stats["accepted_per_position"][i]
  prefix_cache_hits_total            = sum of stats["cached_prompt_tokens"]
  num_preemptions_total              = sum of stats["preemptions"]
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

if TYPE_CHECKING:  # imported when the endpoint starts
    import uvicorn

PREFIX = "tandem:"
FINISH_REASONS = ("stop", "length", "cancelled")

# Buckets in seconds. Inter-token latency reaches down to a millisecond: with speculation a
# round's tokens share its time, so the per-token figure is a fraction of a decode step.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
E2E_BUCKETS = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
ROUND_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.12,
)


class PrometheusMetrics:
    """The metric objects of one server, in their own CollectorRegistry."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        reg, p = self.registry, PREFIX
        self.running = Gauge(
            f"{p}num_requests_running",
            "Requests running (at most runtime.max_batch_size).",
            registry=reg,
        )
        self.waiting = Gauge(
            f"{p}num_requests_waiting", "Requests queued for a row or KV blocks.", registry=reg
        )
        self.finished = Counter(
            f"{p}request_success",
            "Requests finished, by finish reason "
            "(stop: EOS or a stop string; length: max_new_tokens; "
            "cancelled: the client cancelled or went away).",
            ["finished_reason"],
            registry=reg,
        )
        self.prompt_tokens = Counter(
            f"{p}prompt_tokens", "Prompt tokens admitted (cached ones included).", registry=reg
        )
        self.generation_tokens = Counter(
            f"{p}generation_tokens", "Tokens generated (returned to clients).", registry=reg
        )
        self.ttft = Histogram(
            f"{p}time_to_first_token_seconds",
            "From a request's arrival to its first generated token.",
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            f"{p}inter_token_latency_seconds",
            "Per token after a request's "
            "first delivery: time since its previous delivery divided by "
            "the tokens delivered (one observation per token).",
            buckets=ITL_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            f"{p}e2e_request_latency_seconds",
            "From a request's arrival to its end.",
            buckets=E2E_BUCKETS,
            registry=reg,
        )
        self.round = Histogram(
            f"{p}round_duration_seconds",
            "One speculation round of the "
            "batch: from the previous round's end (or this round's start "
            "after a prefill or idling) to its last result.",
            buckets=ROUND_BUCKETS,
            registry=reg,
        )
        self._spec_metrics(reg, p)
        self._kv_metrics(reg, p)
        for reason in FINISH_REASONS:  # present at 0 from the start, as vLLM does
            self.finished.labels(finished_reason=reason)

    def _spec_metrics(self, reg: CollectorRegistry, p: str) -> None:
        self.drafts = Counter(
            f"{p}spec_decode_num_drafts", "Sequence-rounds with a draft (k > 0).", registry=reg
        )
        self.draft_tokens = Counter(
            f"{p}spec_decode_num_draft_tokens", "Draft tokens proposed.", registry=reg
        )
        self.accepted_tokens = Counter(
            f"{p}spec_decode_num_accepted_tokens",
            "Draft tokens accepted by the target.",
            registry=reg,
        )
        self.accepted_per_pos = Counter(
            f"{p}spec_decode_num_accepted_tokens_per_pos",
            "Sequence-rounds that kept the draft token at `position` (0-based).",
            ["position"],
            registry=reg,
        )
        self.target_only = Counter(
            f"{p}spec_decode_num_target_only_rounds",
            "Sequence-rounds without a draft (k = 0; draft_len auto).",
            registry=reg,
        )
        self.draft_len = Gauge(
            f"{p}spec_decode_draft_len", "k of the latest round (0: target-only).", registry=reg
        )

    def _kv_metrics(self, reg: CollectorRegistry, p: str) -> None:
        self.kv_usage = Gauge(
            f"{p}kv_cache_usage_perc",
            "KV-cache usage: the share of the pool's blocks held by running requests (1 = all).",
            registry=reg,
        )
        self.prefix_queries = Counter(
            f"{p}prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", registry=reg
        )
        self.prefix_hits = Counter(
            f"{p}prefix_cache_hits",
            "Prompt tokens found in the prefix cache (not prefilled).",
            registry=reg,
        )
        self.preemptions = Counter(
            f"{p}num_preemptions",
            "Requests preempted for KV blocks (readmitted later, their streams going on).",
            registry=reg,
        )

    # --- what happened (called through ServingMetrics) ------------------------------------
    def watch_blocks(self, usage: Callable[[], float]) -> None:
        """The KV gauge reads the block books when scraped."""
        self.kv_usage.set_function(usage)

    def watch_drops(self, dropped: Callable[[], int]) -> None:
        """tandem:control_frames_dropped_total reads the worker pool's count when scraped:
        frames rank 0 dropped (unsigned, forged or malformed; the log says which)."""
        self.registry.register(
            _ReadCounter(
                f"{PREFIX}control_frames_dropped",
                "Control frames rank 0 dropped: unsigned, "
                "forged or malformed (the log names them).",
                dropped,
            )
        )

    def prefix_lookup(self, queried: int, hit: int) -> None:
        self.prefix_queries.inc(queried)
        self.prefix_hits.inc(hit)

    def watch_load(
        self, running: Callable[[], int], queued: Callable[[], int], max_draft_len: int
    ) -> None:
        """The gauges read the scheduler's state when scraped (any thread: a length read),
        so they are current without an event for every arrival and departure; the
        per-position counter shows every position a round can reach."""
        self.running.set_function(running)
        self.waiting.set_function(queued)
        for position in range(max_draft_len):
            self.accepted_per_pos.labels(position=str(position))

    def prefilled(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def round_done(self, k: int, seconds: float) -> None:
        self.round.observe(seconds)
        self.draft_len.set(k)

    def committed(self, proposed: int, accepted: int, tokens: int) -> None:
        """One sequence's round: `proposed` = k drafts, the first `accepted` kept."""
        if proposed:
            self.drafts.inc()
            self.draft_tokens.inc(proposed)
            self.accepted_tokens.inc(accepted)
        else:
            self.target_only.inc()
        for position in range(accepted):
            self.accepted_per_pos.labels(position=str(position)).inc()
        self.generation_tokens.inc(tokens)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def inter_token(self, seconds: float, tokens: int) -> None:
        for _ in range(tokens):
            self.itl.observe(seconds / tokens)

    def request_finished(self, reason: str, seconds: float | None) -> None:
        """`seconds`: arrival to end; None for a request cancelled while still queued."""
        self.finished.labels(finished_reason=reason).inc()
        if seconds is not None:
            self.e2e.observe(seconds)

    def text(self) -> str:
        """The Prometheus text exposition (format 0.0.4) of this server's registry."""
        return generate_latest(self.registry).decode()


class _ReadCounter:
    """A counter whose total another object keeps (a custom collector, read when scraped)."""

    def __init__(self, name: str, documentation: str, read: Callable[[], int]):
        self.name, self.documentation, self.read = name, documentation, read

    def collect(self):
        yield CounterMetricFamily(self.name, self.documentation, value=self.read())


class MetricsEndpoint:
    """`tandem serve --metrics HOST:PORT`: the registry at GET /metrics on a thread of the
    server process. The socket is bound at construction, before the workers start, so a
    taken port is an early usage error; serving starts once the registry exists."""

    def __init__(self, host: str, port: int):
        family, _, _, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        self.sock = socket.create_server(address, family=family, backlog=64)
        self.sock.set_inheritable(False)
        host, port = self.sock.getsockname()[:2]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self, registry: CollectorRegistry, timeout_s: float = 30.0) -> None:
        """Serve `registry` (prometheus_client's ASGI app on uvicorn); returns once it
        accepts connections."""
        import uvicorn
        from prometheus_client import make_asgi_app

        config = uvicorn.Config(
            make_asgi_app(registry),
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
        server = self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=server.run,
            kwargs={"sockets": [self.sock]},
            name="tandem-metrics",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the --metrics endpoint did not start")
            time.sleep(0.02)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop serving (if started) and release the port."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.sock.close()
