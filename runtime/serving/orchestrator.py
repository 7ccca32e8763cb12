"""Rank 0: turns requests into sequences (tokenise, validate), drives the scheduler, and
hands results back. Used in-process by `tandem run` and by the server loop of `tandem serve`.
It is the one door into serving: callers use submit / step / cancel / has_work / idle /
stats / profile / metrics_text / metrics_registry, never the scheduler or the worker pool
behind it."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

from runtime.config import TandemConfig
from runtime.config.vocab import cross_tokenizer
from runtime.control.pool import WorkerPool
from runtime.errors import ArgumentError, naming
from runtime.models.loading.checkpoint import inspect_checkpoint
from runtime.models.loading.tokenizer import load_tokenizer
from runtime.params import SamplingParams, check_fits, check_prompt_ids
from runtime.serving.block_manager import BlockManager
from runtime.serving.chat import chat_messages_with_tools, check_template_tools, render_chat
from runtime.serving.cross_round import CrossExecutor
from runtime.serving.executor import Executor, run_step
from runtime.serving.metrics import ServingMetrics
from runtime.serving.scheduler import Event, Scheduler, Sequence
from runtime.serving.textstream import TextStream
from runtime.speculation.retokenize import TextBridge

log = logging.getLogger("tandem.orchestrator")


@dataclass(frozen=True)
class _Serving:
    """What attach() gives the orchestrator, whole: the workers, the scheduler that plans
    their steps and the executor that carries the plans out."""

    pool: WorkerPool
    scheduler: Scheduler
    executor: Executor


class Orchestrator:
    def __init__(self, config: TandemConfig):
        self.config = config
        self._serving: _Serving | None = None  # set by attach()
        self.vocab_size = 0
        self.tokenizer = None
        self.eos_token_ids: tuple[int, ...] = ()
        # tokenizer and metadata load on a thread while the workers load their shards
        self._load_error: BaseException | None = None
        self._loader = threading.Thread(target=self._load, name="tokenizer", daemon=True)
        self._loader.start()

    def _load(self) -> None:
        try:
            info = inspect_checkpoint(self.config.target.model)
            tokenizer = load_tokenizer(
                self.config.tokenizer_path, required=self.config.tokenizer is not None
            )
        except BaseException as exc:  # noqa: BLE001 - re-raised by attach()
            self._load_error = exc
            return
        eos = tuple(info.eos_token_ids)
        if not eos and tokenizer is not None and tokenizer.eos_token_id is not None:
            eos = (tokenizer.eos_token_id,)
        self.vocab_size, self.tokenizer, self.eos_token_ids = info.vocab_size, tokenizer, eos

    def _make_executor(self, pool: WorkerPool, metrics: ServingMetrics) -> Executor:
        """What carries out the scheduler's plans on `pool`: a draft with another tokenizer
        rounds through a CrossExecutor (runtime.serving.cross_round)."""
        cfg = self.config
        if not cross_tokenizer(cfg):
            return Executor(pool, cfg.runtime.step_timeout_s, metrics)
        log.info(
            "the draft %s has another tokenizer: its proposals cross as text (two "
            "commands a round, no overlap or drafting ahead)",
            cfg.draft.model,
        )
        bridge = TextBridge(self.tokenizer, load_tokenizer(cfg.draft.model, required=True))
        return CrossExecutor(
            pool,
            cfg.runtime.step_timeout_s,
            metrics,
            bridge,
            cfg.kv_seq_len,
            cfg.speculation.max_draft_len,
        )

    def _loaded(self) -> None:
        """Wait for _load; raise what it raised."""
        self._loader.join()
        if self._load_error is not None:
            raise self._load_error

    def attach(self, pool: WorkerPool) -> Orchestrator:
        """Start scheduling on the workers behind `pool`."""
        self._loaded()
        rt = self.config.runtime
        prefix_caching = rt.prefix_caching and pool.shares_blocks
        if rt.prefix_caching and not pool.shares_blocks:
            log.warning(
                "prefix caching off: a model runs through transformers with its own "
                "KV cache (runtime.prefix_caching needs the paged cache of both)"
            )
        blocks = BlockManager(pool.kv_blocks, rt.kv_block_size, prefix_caching)
        metrics = ServingMetrics()
        executor = self._make_executor(pool, metrics)
        scheduler = Scheduler(
            rt.max_batch_size,
            self.config.speculation.fixed_draft_len,
            self.eos_token_ids,
            overlap=self.config.overlapped and not isinstance(executor, CrossExecutor),
            acceptance=self.config.speculation.acceptance,
            blocks=blocks,
            table_len=self.config.kv_seq_len,
            max_prefill_tokens=self.config.prefill_budget if pool.shares_blocks else None,
            metrics=metrics,
        )
        self._serving = _Serving(pool, scheduler, executor)
        scheduler.metrics.watch(
            lambda: len(scheduler.running), lambda: len(scheduler.queue), scheduler.draft_len
        )
        scheduler.metrics.prometheus.watch_blocks(lambda: blocks.used / blocks.num_blocks)
        scheduler.metrics.prometheus.watch_drops(lambda: pool.dropped_total)
        return self

    def info(self) -> dict:
        return {
            "vocab_size": self.vocab_size,
            "max_seq_len": self.config.runtime.max_seq_len,
            "has_tokenizer": self.tokenizer is not None,
            "model": self.config.target.model,
            "tokenizer": self.config.tokenizer_path,  # the front's token strings (logprobs)
            # where the processes run: a client on this host watches them (runtime.api.client)
            "server": [socket.gethostname(), os.getpid()],
            "processes": {
                str(rank): [host, pid]
                for rank, (host, pid) in sorted(
                    (self._serving.pool.processes if self._serving else {}).items()
                )
            },
        }

    # --- requests ------------------------------------------------------------------------
    def encode(self, text: str, chat: bool = False, tools: list | None = None) -> list[int]:
        if not isinstance(text, str) or not text:
            raise ArgumentError("prompt: expected a non-empty string", "prompt")
        if self.tokenizer is None:
            raise ArgumentError(
                "prompt: this model has no tokenizer; pass prompt_token_ids", "prompt"
            )
        if chat:
            return self.encode_chat([{"role": "user", "content": text}], tools, "prompt")
        return list(self.tokenizer.encode(text))

    def encode_chat(self, messages, tools: list | None = None, name: str = "messages") -> list[int]:
        """A whole conversation (OpenAI's messages, tool calls and tool results included) and
        the `tools` it may call through the tokenizer's chat template, with the assistant's
        generation prompt appended (runtime.serving.chat). Errors are ArgumentErrors naming
        `name` (or tools)."""
        with naming(name):
            checked = chat_messages_with_tools(messages)
        with naming("tools"):
            tools = check_template_tools(tools)
        if self.tokenizer is None:
            words = f"{name}: this model has no tokenizer; pass prompt_token_ids"
            raise ArgumentError(words, name)
        with naming(name):  # the template failed
            ids = render_chat(self.tokenizer, checked, tools, name=name)
        assert isinstance(ids, list)  # tokenize=True
        return ids

    def make_sequences(
        self,
        request_id: str,
        prompts: list[str] | None,
        prompt_ids: list[list[int]] | None,
        params: dict,
        chat: bool = False,
        messages: list[dict] | None = None,
        tools: list[dict] | None = None,
    ) -> list[Sequence]:
        """Validate one request (server side too: a raw client can send anything).
        `messages` is one chat conversation (one sequence) instead of prompts/prompt_ids;
        `tools` go through the chat template with it (or with each chat prompt).
        Needs no worker: `tandem run` makes its sequences before any worker starts."""
        self._loaded()
        sampling = SamplingParams.from_kwargs(**params)
        self._check_vocab(sampling)
        if (prompts is not None) + (prompt_ids is not None) + (messages is not None) != 1:
            raise ValueError("give exactly one of prompt, prompt_token_ids or messages")
        if messages is not None:
            id_lists = [self.encode_chat(messages, tools)]
        elif prompts is not None:
            id_lists = [self.encode(p, chat, tools) for p in prompts]
        else:
            assert prompt_ids is not None  # exactly one of the three was given
            id_lists = [check_prompt_ids(ids, self.vocab_size) for ids in prompt_ids]
        if not id_lists:
            raise ArgumentError("prompt: expected at least one prompt", "prompt")
        name = (
            "messages"
            if messages is not None
            else "prompt"
            if prompts is not None
            else "prompt_token_ids"
        )
        for i, ids in enumerate(id_lists):
            check_prompt_ids(ids, self.vocab_size)
            check_fits(
                len(ids),
                sampling.max_new_tokens,
                self.config.runtime.max_seq_len,
                name,
                i if len(id_lists) > 1 else None,
            )
        return [
            self._sequence(request_id, i, ids, sampling)
            for i, ids in self._fan_out(id_lists, sampling.n)
        ]

    @staticmethod
    def _fan_out(id_lists: list[list[int]], n: int) -> list[tuple[int, list[int]]]:
        """(index, prompt): n samples of each prompt, prompt p's j-th at index p * n + j."""
        return [(p * n + j, ids) for p, ids in enumerate(id_lists) for j in range(n)]

    def _sequence(self, request_id: str, index: int, ids: list[int], sampling) -> Sequence:
        # sequence i of a request samples with seed + i: copies of one prompt (n samples, or
        # a prompt given twice) give independent samples, and the whole request is
        # reproducible
        seed = sampling.seed + index if sampling.seed is not None else secrets.randbits(62)
        stream = TextStream(
            self.tokenizer, sampling.stop, sampling.include_stop_str_in_output,
            sampling.skip_special_tokens,
        )  # fmt: skip
        return Sequence(request_id, index, ids, sampling, stream, seed=seed)

    def _check_vocab(self, sampling: SamplingParams) -> None:
        """What needs the model or the server: stop strings a tokenizer, token ids the
        vocabulary, n and logprobs the configured caps."""
        if sampling.stop and self.tokenizer is None:
            raise ArgumentError("stop: stop strings need a tokenizer; this model has none", "stop")
        for name, ids in (
            ("logit_bias", [t for t, _ in sampling.logit_bias]),
            ("stop_token_ids", list(sampling.stop_token_ids)),
        ):
            for token in ids:
                if token >= self.vocab_size:
                    vocab = f"[0, {self.vocab_size})"
                    words = f"{name}: token id {token} is outside the vocabulary {vocab}"
                    raise ArgumentError(words, name)
        server = self.config.server
        if sampling.n > server.max_n:
            raise ArgumentError(
                f"n: {sampling.n} is more than the {server.max_n} samples a request may ask "
                f"for (server.max_n)",
                "n",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(sampling, name)
            if value is not None and value > server.max_logprobs:
                raise ArgumentError(
                    f"{name}: {value} is more than the {server.max_logprobs} alternatives a "
                    f"token's logprobs may hold (server.max_logprobs)",
                    name,
                )

    # --- the one door into serving ------------------------------------------------------
    @property
    def _on(self) -> _Serving:
        if self._serving is None:
            raise RuntimeError("the orchestrator serves once attach() has given it workers")
        return self._serving

    def submit(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self._on.scheduler.add(seq)

    def step(self, early: Callable[[list[Event]], None] | None = None) -> list[Event]:
        """One step (runtime.serving.executor.run_step): the scheduler plans it, the
        executor carries it out on the workers, the scheduler takes the replies. `early`
        gets the prefill's events (first tokens) before the round runs; the rest are
        returned."""
        return run_step(self._on.scheduler, self._on.executor, early)

    def cancel(self, request_id: str) -> None:
        self._on.scheduler.cancel(request_id)

    @property
    def has_work(self) -> bool:
        return self._on.scheduler.has_work

    def idle(self, timeout_ms: int = 0, wake=()) -> list:
        """Nothing to run: see to the workers (heartbeats, deaths), waiting up to timeout_ms
        for one of them or for one of `wake` (the server's sockets) to be readable, which it
        returns (runtime.control.pool.WorkerPool.idle)."""
        return self._on.pool.idle(timeout_ms, wake)

    def stats(self) -> dict:
        scheduler = self._on.scheduler
        return scheduler.metrics.snapshot(
            len(scheduler.running),
            len(scheduler.queue),
            scheduler.blocks.num_blocks,
            scheduler.blocks.used,
        )

    def profile(self) -> dict:
        """Mean seconds of each worker phase per round (empty unless TANDEM_PROFILE=1)."""
        return self._on.scheduler.metrics.profile()

    def metrics_text(self) -> str:
        """The Prometheus text exposition of this server's metrics (GET /metrics)."""
        return self._on.scheduler.metrics.exposition()

    def metrics_registry(self):
        """This server's prometheus_client CollectorRegistry (`tandem serve --metrics`
        serves it on a thread; prometheus_client's metrics are thread-safe)."""
        return self._on.scheduler.metrics.prometheus.registry

    def run_until_done(self, seqs: list[Sequence]) -> list[dict]:
        self.submit(seqs)
        while not all(s.done for s in seqs):
            self.step()
        failed = [s.error for s in seqs if s.error]
        if failed:
            raise ValueError(failed[0])
        return [s.output() for s in seqs]
