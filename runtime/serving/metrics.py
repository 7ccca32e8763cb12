"""Serving counters and timers, kept outside the scheduler (cf. nano-vllm): the scheduler
tells this module what happened (a round began and ended, a prefill ran, tokens were
committed, a sequence saw its first token or finished); what the server reports is derived
here: the stats reply, and the Prometheus metrics (runtime/serving/prometheus.py) that
`GET /metrics` and `tandem serve --metrics` expose."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from runtime.control.commands import Reply, RoundReply
from runtime.serving.prometheus import PrometheusMetrics


@dataclass
class ServingMetrics:
    tokens_generated: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    rounds: int = 0
    sequence_rounds: int = 0  # one sequence's part of one round
    sequence_rounds_overlapped: int = 0  # ... whose window was drafted during the last verify
    round_time: float = 0.0  # orchestrator's wall time of round commands
    worker_time: float = 0.0  # slowest worker's own time inside those rounds
    between_time: float = 0.0  # orchestrator time from one round's end to the next's start
    betweens: int = 0
    prefill_time: float = 0.0
    prefills: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # ... found there
    preemptions: int = 0
    timing: dict[str, list] = field(default_factory=dict)  # "rank<r>.<phase>" -> [s, rounds]
    started: float = field(default_factory=time.monotonic)
    _last_round_end: float | None = None  # None: the next round follows no round directly
    _round_from: float = 0.0  # where the running round's cost began
    prometheus: PrometheusMetrics = field(default_factory=PrometheusMetrics, repr=False)

    def round_begins(self) -> float:
        """A round command is about to be sent; returns its start time."""
        start = time.perf_counter()
        previous_end = self._last_round_end
        if previous_end is not None:
            self.between_time += start - previous_end
            self.betweens += 1
        # a round's cost is end to end: with draft-ahead the draft ran before the command
        self._round_from = previous_end if previous_end is not None else start
        return start

    def round_ends(self, start: float, results: dict[int, Reply], k: int) -> float:
        """The round (k drafts per sequence) has its results (one per rank); returns the
        round's cost in seconds."""
        end = self._last_round_end = time.perf_counter()
        self.rounds += 1
        self.round_time += end - start
        rounds = {rank: r for rank, r in results.items() if isinstance(r, RoundReply)}
        self.worker_time += max((r.worker_s for r in rounds.values()), default=0.0)
        for rank, result in rounds.items():
            for phase, seconds in result.timing.items():
                total = self.timing.setdefault(f"rank{rank}.{phase}", [0.0, 0])
                total[0] += seconds
                total[1] += 1
        self.prometheus.round_done(k, end - self._round_from)
        return end - self._round_from

    def idle(self) -> None:
        """Nothing runs: the next round's cost must not include the wait."""
        self._last_round_end = None

    def prefill_done(self, seconds: float, prompt_tokens: int) -> None:
        self.prometheus.prefilled(prompt_tokens)
        self.prefill_time += seconds
        self.prefills += 1
        self._last_round_end = None  # the next round's cost must not include this prefill

    def committed(
        self, proposed: int, accepted: int, tokens: int, overlapped: bool = False
    ) -> None:
        """A sequence's round outcome: k drafts proposed, `accepted` kept, `tokens` new;
        `overlapped`: its window was drafted during the last round's verify."""
        self.sequence_rounds += 1
        self.sequence_rounds_overlapped += overlapped
        self.draft_tokens_proposed += proposed
        self.draft_tokens_accepted += accepted
        self.tokens_generated += tokens
        self.prometheus.committed(proposed, accepted, tokens)

    def first_token(self, seconds: float) -> None:
        """A sequence's first tokens came `seconds` after its request arrived."""
        self.prometheus.first_token(seconds)

    def delivered(self, seconds: float, tokens: int) -> None:
        """A sequence's later tokens: `tokens` of them, `seconds` after its previous ones."""
        self.prometheus.inter_token(seconds, tokens)

    def prefill_tokens(self, tokens: int) -> None:
        """A sequence's first token, which its prefill brought (no round)."""
        self.tokens_generated += tokens
        self.prometheus.generation_tokens.inc(tokens)

    def preempted(self) -> None:
        self.preemptions += 1
        self.prometheus.preemptions.inc()

    def prefix_lookup(self, queried: int, hit: int) -> None:
        """A request admitted: `queried` prompt tokens looked up, `hit` of them cached."""
        self.prefix_queries += queried
        self.prefix_hits += hit
        self.prometheus.prefix_lookup(queried, hit)

    def finished(self, reason: str, seconds: float | None) -> None:
        """A sequence ended (`seconds` after it arrived; None: cancelled while queued)."""
        self.prometheus.request_finished(reason, seconds)

    def watch(
        self, running: Callable[[], int], queued: Callable[[], int], max_draft_len: int
    ) -> None:
        """Where the gauges read the running and queued counts when scraped."""
        self.prometheus.watch_load(running, queued, max_draft_len)

    def exposition(self) -> str:
        """The Prometheus text of this server's metrics (GET /metrics)."""
        return self.prometheus.text()

    def overheads(self) -> dict:
        """Mean seconds per round: the workers' own time, the control plane (command sent to
        last result received, less the workers' time) and the orchestrator between rounds."""
        rounds = max(self.rounds, 1)
        return {
            "mean_worker_round_s": self.worker_time / rounds,
            "mean_control_s": (self.round_time - self.worker_time) / rounds,
            "mean_between_rounds_s": self.between_time / max(self.betweens, 1),
        }

    def profile(self) -> dict:
        """Mean seconds of each worker phase over the rounds that had it (drafted rounds
        and target-only rounds have different phases; empty unless profiling)."""
        return {k: seconds / rounds for k, (seconds, rounds) in sorted(self.timing.items())}

    def snapshot(
        self, running: int, queued: int, kv_blocks_total: int = 0, kv_blocks_used: int = 0
    ) -> dict:
        """The server's stats reply."""
        elapsed = time.monotonic() - self.started
        proposed = self.draft_tokens_proposed
        return {
            "running": running,
            "queued": queued,
            "kv_blocks_total": kv_blocks_total,
            "kv_blocks_used": kv_blocks_used,
            "prefix_cache_hit_rate": self.prefix_hits / self.prefix_queries
            if self.prefix_queries
            else 0.0,
            "num_preemptions": self.preemptions,
            "tokens_generated": self.tokens_generated,
            "rounds": self.rounds,
            "acceptance_rate": self.draft_tokens_accepted / proposed if proposed else 0.0,
            "tokens_per_s": self.tokens_generated / elapsed if elapsed > 0 else 0.0,
            "mean_round_s": self.round_time / self.rounds if self.rounds else 0.0,
            "mean_prefill_s": self.prefill_time / self.prefills if self.prefills else 0.0,
            "overlap_share": self.sequence_rounds_overlapped / self.sequence_rounds
            if self.sequence_rounds
            else 0.0,
            **self.overheads(),
            "profile": self.profile(),
            "uptime_s": elapsed,
        }
