"""A worker's startup: load its models (tensor-parallel shards where the config says so),
preallocate their KV caches within the memory budget, capture the CUDA graphs of its steps."""
from __future__ import annotations

import copy
import logging
import time

import torch

from parallel.groups import Groups, TPInfo
from parallel.topology import WorkerSpec
from runtime.config import TandemConfig
from runtime.control.progress import ProgressReporter
from runtime.worker.shards import DraftShard, TargetShard

log = logging.getLogger("tandem.worker")


def load_shards(config: TandemConfig, spec: WorkerSpec, groups: Groups, device: torch.device,
                rank: int, progress: ProgressReporter | None = None
                ) -> tuple[DraftShard | None, TargetShard | None]:
    """(draft shard, target shard) of the worker `spec`; None for a model it does not host.
    `progress` hears of every tensor loaded and every CUDA graph captured (all loads come
    before the first capture, so the orchestrator's phases follow one another)."""
    from parallel.vocab import VocabParallel
    from runtime.models import load_model

    draft_cfg, target_cfg = config.draft, config.target
    draft = target = target_model = None
    if spec.hosts_target:
        tp = TPInfo(groups.target_tp, spec.target_tp_rank, target_cfg.tp_size)
        target_model = load_model(target_cfg.model, target_cfg.torch_dtype, device, tp,
                                  gather_logits=not tp.enabled,
                                  quantization=target_cfg.quantization,
                                  progress=_callback(progress, "weights"))
    if spec.hosts_draft:
        same = (draft_cfg.model, draft_cfg.dtype, draft_cfg.devices,
                draft_cfg.quantization) == (target_cfg.model, target_cfg.dtype,
                                            target_cfg.devices, target_cfg.quantization)
        if same and target_model is not None and draft_cfg.tp_size == 1:
            draft_model = copy.deepcopy(target_model)  # load once; own KV cache
        else:
            tp = TPInfo(groups.draft_tp, spec.draft_tp_rank, draft_cfg.tp_size)
            draft_model = load_model(draft_cfg.model, draft_cfg.torch_dtype, device, tp,
                                     quantization=draft_cfg.quantization,
                                     progress=_callback(progress, "weights"))
        # decode steps: the pending token(s) (1 or 2), then one token at a time
        draft = _shard(config, DraftShard, "draft", draft_model, [1, 2], device, rank,
                       progress)
    if target_model is not None:
        spec_cfg = config.speculation   # verify steps: pending + k draft tokens
        ks = [spec_cfg.draft_len] if spec_cfg.fixed_draft_len else \
            list(range(1, spec_cfg.max_draft_len + 1))
        target = _shard(config, TargetShard, "target", target_model, [k + 1 for k in ks],
                        device, rank, progress)
        if target_cfg.tp_size > 1:  # verify without gathering the vocabulary if greedy
            target.vocab_parallel = VocabParallel.of(target_model, groups.target_tp)
    return draft, target


def _callback(progress: ProgressReporter | None, phase: str):
    return None if progress is None else progress.callback(phase)


def _shard(config: TandemConfig, cls, key: str, model, step_lens: list[int],
           device: torch.device, rank: int, progress: ProgressReporter | None = None):
    """A shard with its KV cache preallocated within the model's memory budget; steps of
    these lengths run as CUDA graphs, all captured now, and so do the prompts' chunks
    (runtime.models.runners.prefill_runner). A tensor-parallel shard's graphs hold its NCCL
    all-reduces; every rank of the group captures the same shapes in the same order."""
    from runtime.models.runners.kv_budget import check_kv_budget

    rt, model_cfg = config.runtime, getattr(config, key)
    # room past max_seq_len for one window of drafts (two when the next is drafted ahead
    # during verification: overlap) and the pending tokens
    windows = 2 if config.overlapped else 1
    cache_len = rt.max_seq_len + windows * config.speculation.max_draft_len + 2
    check_kv_budget(key, model, rt.max_batch_size, cache_len, model_cfg.kv_cache_memory, device,
                    rt.kv_block_size)
    shard = cls(model, device, rt.max_batch_size, cache_len, config.speculation.acceptance,
                max(step_lens), rt.cuda_graphs, block_size=rt.kv_block_size)
    start = time.perf_counter()
    count = shard.runner.capture_all(step_lens, progress=_callback(progress, "graphs"))
    if count:
        chunked = shard.runner.chunked
        log.info("rank %d: %s: %d CUDA graphs captured in %.1f s (%d of them prefill chunks)",
                 rank, key, count, time.perf_counter() - start,
                 len(chunked.graphs) if chunked is not None else 0)
    return shard
