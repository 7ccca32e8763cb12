"""A worker's startup: load its models (tensor-parallel shards where the config says so),
agree with every worker on the KV pool's size, allocate the pools, capture the CUDA graphs of
its steps."""

from __future__ import annotations

import copy
import logging
import time

import torch

from parallel.groups import Groups, TPInfo
from parallel.topology import WorkerSpec
from runtime.config import TandemConfig
from runtime.control.progress import ProgressReporter
from runtime.worker.draft_shard import DraftShard
from runtime.worker.target_shard import TargetShard

log = logging.getLogger("tandem.worker")


def load_shards(
    config: TandemConfig,
    spec: WorkerSpec,
    groups: Groups,
    device: torch.device,
    rank: int,
    progress: ProgressReporter | None = None,
) -> tuple[DraftShard | None, TargetShard | None, int]:
    """(draft shard, target shard, the KV pool's blocks) of the worker `spec`; None for a
    model it does not host. Both models load first, then every worker agrees on the pool's
    size (runtime.worker.kv_pool, collective), then the shards allocate their pools and
    capture their graphs. `progress` hears of every tensor loaded and every CUDA graph
    captured (all loads come before the first capture, so the orchestrator's phases follow
    one another)."""
    from parallel.vocab import VocabParallel
    from runtime.config.vocab import cross_tokenizer
    from runtime.worker.kv_pool import pool_blocks

    target_model = _load_target(config, spec, groups, device, progress)
    draft_model = _load_draft(config, spec, groups, device, progress, target_model)
    models = {
        key: model
        for key, model in (("draft", draft_model), ("target", target_model))
        if model is not None
    }
    num_blocks = pool_blocks(config, models, device, groups.bridge)
    draft = target = None
    if draft_model is not None:
        cross = cross_tokenizer(config)  # its own positions: its own fixed block tables
        # decode steps: the pending token(s) (1 or 2), then one token at a time
        draft = _shard(
            config,
            DraftShard,
            "draft",
            draft_model,
            [1, 2],
            device,
            rank,
            None if cross else num_blocks,
            progress,
        )
        draft.cross = cross
        draft.vocab = None if cross else _draft_vocab(config, draft_model)
        draft.follows_grammars = config.speculation.mask_draft
    if target_model is not None:
        spec_cfg = config.speculation  # verify steps: pending + k draft tokens
        fixed = spec_cfg.fixed_draft_len
        ks = [fixed] if fixed else list(range(1, spec_cfg.max_draft_len + 1))
        target = _shard(
            config,
            TargetShard,
            "target",
            target_model,
            [k + 1 for k in ks],
            device,
            rank,
            num_blocks,
            progress,
        )
        if config.target.tp_size > 1 and groups.target_tp is not None:
            # verify without gathering the vocabulary if greedy
            target.vocab_parallel = VocabParallel.of(target_model, groups.target_tp)
    return draft, target, num_blocks


def _load_target(
    config: TandemConfig,
    spec: WorkerSpec,
    groups: Groups,
    device: torch.device,
    progress: ProgressReporter | None,
):
    from runtime.models import load_model

    if spec.target_tp_rank is None:  # no target shard here
        return None
    cfg = config.target
    tp = TPInfo(groups.target_tp, spec.target_tp_rank, cfg.tp_size)
    return load_model(
        cfg.model,
        cfg.torch_dtype,
        device,
        tp,
        gather_logits=not tp.enabled,
        quantization=cfg.quantization,
        progress=_callback(progress, "weights"),
    )


def _load_draft(
    config: TandemConfig,
    spec: WorkerSpec,
    groups: Groups,
    device: torch.device,
    progress: ProgressReporter | None,
    target_model,
):
    from runtime.models import load_model

    if spec.draft_tp_rank is None:  # no draft shard here
        return None
    draft_cfg, target_cfg = config.draft, config.target
    same = (draft_cfg.model, draft_cfg.dtype, draft_cfg.devices, draft_cfg.quantization) == (
        target_cfg.model,
        target_cfg.dtype,
        target_cfg.devices,
        target_cfg.quantization,
    )
    if same and target_model is not None and draft_cfg.tp_size == 1:
        return copy.deepcopy(target_model)  # load once; own KV cache
    tp = TPInfo(groups.draft_tp, spec.draft_tp_rank, draft_cfg.tp_size)
    return load_model(
        draft_cfg.model,
        draft_cfg.torch_dtype,
        device,
        tp,
        quantization=draft_cfg.quantization,
        progress=_callback(progress, "weights"),
    )


def _draft_vocab(config: TandemConfig, draft_model):
    """The draft's DraftVocab when its vocab_size differs from the target's (an embedding
    padded differently over one tokenizer: runtime.config.vocab), else None."""
    from runtime.config.vocab import propose_limit
    from runtime.models.loading.checkpoint import inspect_checkpoint
    from runtime.speculation.vocab import DraftVocab

    embed = draft_model.vocab_size
    width = inspect_checkpoint(config.target.model).vocab_size
    limit = propose_limit(config, embed, width)
    return None if limit is None else DraftVocab(limit, width, embed)


def _callback(progress: ProgressReporter | None, phase: str):
    return None if progress is None else progress.callback(phase)


def _shard(
    config: TandemConfig,
    cls,
    key: str,
    model,
    step_lens: list[int],
    device: torch.device,
    rank: int,
    num_blocks: int | None,
    progress: ProgressReporter | None = None,
):
    """A shard with its pool of num_blocks KV blocks; steps of these lengths run as CUDA
    graphs, all captured now, and so do the prompts' chunks
    (runtime.models.runners.prefill_runner). A tensor-parallel shard's graphs hold its NCCL
    all-reduces; every rank of the group captures the same shapes in the same order."""
    rt = config.runtime
    shard = cls(
        model,
        device,
        rt.max_batch_size,
        config.kv_seq_len,
        config.speculation.acceptance,
        max(step_lens),
        rt.cuda_graphs,
        block_size=rt.kv_block_size,
        num_blocks=num_blocks,
        kv_dtype=rt.kv_cache_dtype,
        verification=config.speculation.verification,
    )
    start = time.perf_counter()
    count = shard.runner.capture_all(step_lens, progress=_callback(progress, "graphs"))
    if count:
        chunked = shard.runner.chunked
        log.info(
            "rank %d: %s: %d CUDA graphs captured in %.1f s (%d of them prefill chunks)",
            rank,
            key,
            count,
            time.perf_counter() - start,
            len(chunked.graphs) if chunked is not None else 0,
        )
    return shard
