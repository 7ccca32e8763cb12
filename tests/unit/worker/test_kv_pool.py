"""The KV pool's size on a worker (runtime.worker.kv_pool): runtime.kv_cache_tokens, the
models' kv_cache_memory shares, else free memory after the weights and the steps; a pool too
small for one request names the key of the budget that made it so."""

from __future__ import annotations

import pytest
import torch

from runtime.config import load_config
from runtime.models import load_model
from runtime.models.arch.cache import blocks_for
from runtime.models.runners.kv_budget import block_bytes
from runtime.worker import kv_pool
from tests import launch

pytestmark = pytest.mark.timeout(60)
CPU = torch.device("cpu")
GIB = 1024**3


@pytest.fixture(scope="module")
def model(llama_path):
    return load_model(llama_path, torch.float32, CPU)


def config(llama_path, tmp_path, target=None, **runtime):
    path = launch.write_config(tmp_path / "c.yaml", llama_path, llama_path, **runtime)
    cfg = load_config(path, check_devices=False)
    if target:
        import dataclasses

        cfg = dataclasses.replace(cfg, target=dataclasses.replace(cfg.target, **target))
    return cfg


def test_sizes_in_order(llama_path, model, tmp_path, monkeypatch):
    monkeypatch.setattr(kv_pool, "device_memory", lambda device: (8 * GIB, 16 * GIB))
    cfg = config(llama_path, tmp_path)
    per_request = blocks_for(cfg.kv_seq_len, 16)
    # CPU default: max_batch_size requests of max_seq_len (memory is plenty)
    assert kv_pool.pool_blocks(cfg, {"target": model}, CPU, None) == 4 * per_request
    tokens = config(llama_path, tmp_path, kv_cache_tokens=16 * per_request * 3 + 5)
    assert kv_pool.pool_blocks(tokens, {"target": model}, CPU, None) == 3 * per_request + 1
    share = config(llama_path, tmp_path, target={"kv_cache_memory": 1e-5})
    expect = int(1e-5 * 16 * GIB // block_bytes(model, 16))
    assert per_request <= expect < 4 * per_request  # the share, below the CPU default
    assert kv_pool.pool_blocks(share, {"target": model}, CPU, None) == expect


def test_a_pool_too_small_names_its_budget(llama_path, model, tmp_path, monkeypatch):
    monkeypatch.setattr(kv_pool, "device_memory", lambda device: (8 * GIB, 16 * GIB))
    small = config(llama_path, tmp_path, target={"kv_cache_memory": 1e-9})
    with pytest.raises(MemoryError, match=r"^target KV cache needs .*target\.kv_cache_memory"):
        kv_pool.pool_blocks(small, {"target": model}, CPU, None)
    monkeypatch.setattr(kv_pool, "device_memory", lambda device: (1 << 20, 16 * GIB))
    cfg = config(llama_path, tmp_path, kv_cache_tokens=100_000)
    with pytest.raises(MemoryError, match="runtime.kv_cache_tokens 100000 does not fit"):
        kv_pool.pool_blocks(cfg, {"target": model}, CPU, None)


def test_a_worker_whose_budget_is_not_the_cause_only_waits(
    llama_path, model, tmp_path, monkeypatch
):
    """The all-reduce MIN brought a smaller count from another worker."""
    monkeypatch.setattr(kv_pool, "device_memory", lambda device: (8 * GIB, 16 * GIB))

    def other_worker_has_none(count, op, group):
        count.fill_(0)

    monkeypatch.setattr(kv_pool.dist, "all_reduce", other_worker_has_none)
    with pytest.raises(kv_pool.PoolTooSmallElsewhere, match="another worker"):
        kv_pool.pool_blocks(config(llama_path, tmp_path), {"target": model}, CPU, object())


def test_step_bytes_count_a_long_prompt_chunk(llama_path, model, tmp_path):
    """The free-memory budget leaves room for the steps' logits and for one long prompt
    chunk's activations (prefill_runner.long_chunk_bytes), which grow with its tokens."""
    from runtime.models.runners.prefill_runner import LONG_TOKENS, long_chunk_bytes

    cfg = config(llama_path, tmp_path)
    chunk = long_chunk_bytes(model)
    assert chunk > 0 and long_chunk_bytes(model, 2 * LONG_TOKENS) == 2 * chunk
    args = model.args
    assert chunk >= LONG_TOKENS * 4 * 2 * args.intermediate_size  # gate/up as float32
    rows = cfg.runtime.max_batch_size * (cfg.speculation.max_draft_len + 2)
    assert kv_pool.step_bytes(cfg, model) == 16 * rows * model.vocab_size + chunk
