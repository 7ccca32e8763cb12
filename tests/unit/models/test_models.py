"""runtime.models: our Llama-family model, its KV cache and loaders, and the HF fallback."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from runtime.models import CausalLM, HFFallbackModel, LlamaForCausalLM, load_model
from runtime.models.arch.base import is_paged
from runtime.models.runners.step_runner import StepRunner
from tests.checkpoints import (
    build_checkpoint,
    hf_generate,
    hf_greedy,
    smollm2_gguf,
    smollm2_transformers,
)
from tests.model_helpers import (
    build_fallback_checkpoint,
    build_sharded_checkpoint,
    extend,
    extend_ragged,
    greedy,
    hf_logits,
)

pytestmark = pytest.mark.timeout(120)

F32 = torch.float32
CPU = torch.device("cpu")
SEQ_LEN = 24
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

VARIANTS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "mistral": ("mistral", {}),
    "mistral_window4": ("mistral", {"sliding_window": 4}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "llama3_rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama_head_dim32": ("llama", {"head_dim": 32}),
    "llama_sharded": ("llama", {"sharded": True}),
}


def _sequence(seed: int, n: int = SEQ_LEN) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 96, (n,), generator=g).tolist()


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    """(name, checkpoint path, transformers reference model) of one tiny variant."""
    import transformers

    arch, overrides = VARIANTS[request.param]
    overrides = dict(overrides)
    out = tmp_path_factory.mktemp(request.param)
    if overrides.pop("sharded", False):
        path = build_sharded_checkpoint(out, arch=arch, seed=3, **overrides)
    else:
        path = build_checkpoint(out, arch=arch, seed=3, **overrides)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=F32).eval()
    return request.param, path, ref


def _ours(path: str, num_slots: int = 4, max_seq_len: int = 64) -> LlamaForCausalLM:
    model = load_model(path, F32, CPU)
    assert isinstance(model, LlamaForCausalLM)
    model.allocate_cache(num_slots, max_seq_len)
    return model


# ---------------------------------------------------------------- our Llama-family model


def test_full_prompt_matches_hf(tiny):
    _, path, ref = tiny
    model = _ours(path)
    seq = _sequence(0)
    torch.testing.assert_close(extend(model, 2, 0, seq), hf_logits(ref, seq), atol=1e-4, rtol=0)


def test_incremental_matches_full(tiny):
    _, path, ref = tiny
    model = _ours(path)
    seq = _sequence(1)
    full = hf_logits(ref, seq)
    start = 0
    for size in (5, 1, 1, 3, 1, 6, 1, 2, 4):  # sums to SEQ_LEN
        got = extend(model, 1, start, seq[start : start + size])
        torch.testing.assert_close(got, full[start : start + size], atol=1e-4, rtol=0)
        start += size
    assert start == SEQ_LEN


def test_ragged_batch_matches_single_rows(tiny):
    _, path, ref = tiny
    seqs = [_sequence(10 + i) for i in range(3)]
    batched, alone = _ours(path), _ours(path)
    for model in (batched, alone):  # history: slot 0 holds 5 tokens, slot 1 holds 9
        extend(model, 0, 0, seqs[0][:5])
        extend(model, 1, 0, seqs[1][:9])
    steps = [
        [(1, 9, seqs[1][9:12]), (0, 5, seqs[0][5:6]), (3, 0, seqs[2][:7])],
        [(3, 7, seqs[2][7:8]), (1, 12, seqs[1][12:20]), (0, 6, seqs[0][6:9])],
    ]
    for rows in steps:
        got = extend_ragged(batched, rows, pad=-1)  # out-of-vocab pad must be harmless
        for (slot, start, ids), logits in zip(rows, got):
            row_alone = extend(alone, slot, start, ids)
            # float32 GEMMs of other shapes round differently (1.1e-5 seen on AVX-512 hosts);
            # a masking or position fault moves logits by 1e-2 or more
            torch.testing.assert_close(logits, row_alone, atol=5e-5, rtol=0)
            seq = seqs[[0, 1, None, 2][slot]]
            want = hf_logits(ref, seq[: start + len(ids)])[start:]
            torch.testing.assert_close(logits, want, atol=1e-4, rtol=0)


def test_rollback_discards_positions_after_start(tiny):
    _, path, ref = tiny
    model = _ours(path)
    seq, garbage = _sequence(20), _sequence(21, 10)
    full = hf_logits(ref, seq)
    extend(model, 3, 0, seq[:8])
    extend(model, 3, 8, garbage)  # written at positions 8..17
    extend_ragged(model, [(3, 18, garbage[:4]), (0, 0, garbage)])
    got = extend(model, 3, 6, seq[6:12])  # roll back to 6: also rewrites 6 and 7
    torch.testing.assert_close(got, full[6:12], atol=1e-4, rtol=0)
    got = extend(model, 3, 12, seq[12:16])
    torch.testing.assert_close(got, full[12:16], atol=1e-4, rtol=0)


def test_greedy_matches_hf_generate(tiny):
    _, path, _ = tiny
    model = _ours(path)
    prompt = _sequence(30, 6)
    assert greedy(model, prompt, 16, eos_token_id=2) == hf_greedy(path, prompt, 16)


def test_variant_structure(tiny):
    """The features each variant exists for are really exercised."""
    name, path, _ = tiny
    model = _ours(path)
    attn = model.model.layers[0].self_attn
    assert (attn.n_heads, attn.n_kv_heads) == (4, 2)  # GQA
    assert attn.head_dim == (32 if name == "llama_head_dim32" else 16)
    has_bias = name == "qwen2"
    assert (attn.q_proj.bias is not None) == has_bias
    assert (attn.k_proj.bias is not None) == has_bias
    assert (attn.v_proj.bias is not None) == has_bias
    assert attn.o_proj.bias is None
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == (name == "llama_tied")
    if name == "llama_sharded":
        index = json.loads((Path(path) / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
    if name == "llama3_rope":
        default = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
        assert not torch.allclose(model.rotary_emb.inv_freq, default)
    if name == "mistral_window4":
        assert attn.sliding_window == 4
        seq = _sequence(40, 12)
        windowed = extend(model, 0, 0, seq)
        for layer in model.model.layers:
            layer.self_attn.sliding_window = None
        assert (extend(model, 0, 0, seq) - windowed).abs().max() > 1e-3


# ---------------------------------------------------------------- cache, dtype, interface


def test_cache_bounds_and_protocol(tmp_path):
    path = build_checkpoint(tmp_path, arch="llama", seed=4)
    model = load_model(path, F32, CPU)
    assert isinstance(model, CausalLM) and model.vocab_size == 96 and not model.training
    assert is_paged(model)  # a PagedModel: its class says so
    with pytest.raises(RuntimeError, match="allocate_cache"):
        extend(model, 0, 0, [5, 6])
    model.allocate_cache(2, 16)
    cache = model.model.layers[0].self_attn.kv_cache
    # 2 slots x 1 block of 16 positions (runtime.kv_block_size) + the scratch block
    assert cache.k_cache.shape == (2 + 1, 2, 16, 16)
    extend(model, 1, 10, [5] * 6)  # exactly fills positions 10..15
    with pytest.raises(ValueError, match="max_seq_len"):
        extend(model, 1, 11, [5] * 6)
    with pytest.raises(ValueError, match="slot"):
        extend(model, 2, 0, [5])
    model.free_slot(1)


def test_bfloat16_load(tmp_path):
    path = build_checkpoint(tmp_path, arch="qwen2", seed=5)
    model = load_model(path, "bfloat16", CPU)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.rotary_emb.inv_freq.dtype == F32
    model.allocate_cache(1, 32)
    assert model.model.layers[0].self_attn.kv_cache.k_cache.dtype == torch.bfloat16
    ref = _ours(path)
    seq = _sequence(50, 10)
    got = extend(model, 0, 0, seq)
    assert got.isfinite().all()
    assert (got.argmax(-1) == extend(ref, 0, 0, seq).argmax(-1)).float().mean() > 0.7


def test_rope_parameters_both_config_styles():
    from runtime.models.arch.model_args import rope_parameters

    old = types.SimpleNamespace(rope_theta=500000.0, rope_scaling=None)
    assert rope_parameters(old) == {"rope_theta": 500000.0, "rope_type": "default"}
    old_scaled = types.SimpleNamespace(
        rope_theta=1e4, rope_scaling={"type": "linear", "factor": 2.0}
    )
    assert rope_parameters(old_scaled)["rope_type"] == "linear"
    new = types.SimpleNamespace(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5})
    assert rope_parameters(new)["rope_theta"] == 5e5


# ---------------------------------------------------------------- SmolLM2 GGUF


@pytest.fixture(scope="module")
def smollm2():
    """(gguf path, our model, transformers' model loaded with gguf_file=)."""
    path = smollm2_gguf()
    return path, load_model(path, F32, CPU), smollm2_transformers()


SMOL_PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 11173, 30, 216, 504, 3458]


def test_smollm2_gguf_logits_match_transformers(smollm2):
    _, ours, ref = smollm2
    assert isinstance(ours, LlamaForCausalLM)
    assert ours.vocab_size == 49152 and len(ours.model.layers) == 30
    assert ours.args.tie_word_embeddings
    ours.allocate_cache(2, 64)
    want = hf_logits(ref, SMOL_PROMPT)
    torch.testing.assert_close(extend(ours, 1, 0, SMOL_PROMPT), want, atol=1e-3, rtol=0)
    extend(ours, 0, 0, SMOL_PROMPT[:7])  # incremental, batched with another slot
    got = extend_ragged(ours, [(0, 7, SMOL_PROMPT[7:]), (1, 3, SMOL_PROMPT[3:5])])
    torch.testing.assert_close(got[0], want[7:], atol=1e-3, rtol=0)
    torch.testing.assert_close(got[1], want[3:5], atol=1e-3, rtol=0)


def test_smollm2_gguf_greedy_matches_transformers(smollm2):
    _, ours, ref = smollm2
    ours.allocate_cache(1, 64)
    assert greedy(ours, SMOL_PROMPT, 8, eos_token_id=2) == hf_generate(ref, SMOL_PROMPT, 8)


# ---------------------------------------------------------------- transformers fallback


@pytest.fixture(scope="module", params=["gpt2", "opt"])
def fallback(request, tmp_path_factory):
    import transformers

    path = build_fallback_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=6)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=F32).eval()
    model = load_model(path, F32, CPU)
    assert isinstance(model, HFFallbackModel) and isinstance(model, CausalLM)
    assert model.vocab_size == 96 and not model.hf_model.training
    model.allocate_cache(4, 64)
    return model, ref


def test_fallback_full_and_incremental(fallback):
    model, ref = fallback
    seq = _sequence(60)
    full = hf_logits(ref, seq)
    torch.testing.assert_close(extend(model, 0, 0, seq), full, atol=1e-4, rtol=0)
    start = 0
    for size in (7, 1, 4, 12):
        got = extend(model, 2, start, seq[start : start + size])
        torch.testing.assert_close(got, full[start : start + size], atol=1e-4, rtol=0)
        start += size


def test_fallback_is_no_paged_model(fallback):
    """The fallback says it is no PagedModel: a step runner gives it its slots as rows, in
    one eager forward_extend (no static steps, block tables or prefill chunks)."""
    model, ref = fallback
    assert not is_paged(model)
    runner = StepRunner(model, CPU, max_batch=4, max_step_len=2)
    assert not runner.static and runner.table is None and runner.chunked is None
    seq = _sequence(90, 5)
    got = runner.run(torch.tensor([seq]), [3], [0], [5])
    torch.testing.assert_close(got[0], hf_logits(ref, seq), atol=1e-4, rtol=0)


def test_fallback_ragged_batch(fallback):
    model, ref = fallback
    seqs = [_sequence(70 + i) for i in range(2)]
    extend(model, 1, 0, seqs[0][:6])
    rows = [(1, 6, seqs[0][6:9]), (3, 0, seqs[1][:5])]
    got = extend_ragged(model, rows, pad=-1)
    torch.testing.assert_close(got[0], hf_logits(ref, seqs[0][:9])[6:], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[1], hf_logits(ref, seqs[1][:5]), atol=1e-4, rtol=0)


def test_fallback_rollback(fallback):
    model, ref = fallback
    seq, garbage = _sequence(80), _sequence(81, 7)
    full = hf_logits(ref, seq)
    extend(model, 0, 0, seq[:8])
    extend(model, 0, 8, garbage)
    torch.testing.assert_close(extend(model, 0, 5, seq[5:12]), full[5:12], atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="cannot extend"):
        extend(model, 0, 13, [5])  # a gap: slot holds 12 positions
    model.free_slot(0)
    torch.testing.assert_close(extend(model, 0, 0, seq[:4]), full[:4], atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        extend(model, 0, 4, [5] * 61)


# ---------------------------------------------------------------- loading errors


def test_bad_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model(tmp_path / "nope", F32, CPU)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path, F32, CPU)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="gguf"):
        load_model(tmp_path / "weights.bin", F32, CPU)


def test_missing_weight_files(tmp_path):
    single = Path(build_checkpoint(tmp_path / "single", arch="llama", seed=7))
    (single / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no safetensors"):
        load_model(single, F32, CPU)
    sharded = Path(build_sharded_checkpoint(tmp_path / "sh", arch="llama", seed=7))
    shard = sorted(sharded.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_model(sharded, F32, CPU)


def test_missing_and_unexpected_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    path = Path(build_checkpoint(tmp_path, arch="llama", seed=8))
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing tensors: model.layers.1.mlp.up_proj.weight"):
        load_model(path, F32, CPU)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(128, 64)
    tensors["model.layers.9.extra.weight"] = torch.zeros(3)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected tensors: model.layers.9.extra.weight"):
        load_model(path, F32, CPU)
    tensors.pop("model.layers.9.extra.weight")
    tensors["model.norm.weight"] = torch.zeros(65)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.norm.weight: checkpoint shape"):
        load_model(path, F32, CPU)
