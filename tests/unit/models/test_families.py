"""Qwen3, OLMo 2, Phi-3, Gemma 3 (text) and Gemma 2 on our Llama-family model
(model_args.QK_NORM, POST_NORMS, GEMMA, loading.fused_tensors): logits equal transformers' (eager
forward_extend, StepRunner's
static chunked prefill and decode steps over the paged cache, TP 2 in a gloo world), FP8
quantize-on-load equals its dequantized float reference, and the config checks take them.

The tiny checkpoints' norm weights are drawn around 1 (tests.checkpoints._perturb_norms), so
a norm skipped, misplaced or taken over the wrong features moves the logits (Gemma's around
0: it scales by 1 + w). The Gemmas' attention scale, windows and soft-caps are set so each
matters at these lengths (tests.checkpoints.GEMMA_DEFAULTS; tests/unit/models/test_gemma.py
shows they do, and runs their Triton kernels)."""

from __future__ import annotations

import datetime
import json
import os
import traceback
from pathlib import Path

import pytest
import torch

from runtime.models import LlamaForCausalLM, load_model
from runtime.models.arch import quant
from runtime.models.arch.model_args import NormPlacement, unsupported_reason
from runtime.models.runners.step_runner import StepRunner
from tests import fp8_checkpoints as fc
from tests.checkpoints import build_checkpoint
from tests.model_helpers import extend, hf_logits

pytestmark = pytest.mark.timeout(240)

F32 = torch.float32
CPU = torch.device("cpu")
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0 + 0.1 * i for i in range(8)],
    "long_factor": [2.0 + 0.3 * i for i in range(8)],
    "original_max_position_embeddings": 64,
}
VARIANTS = {
    "qwen3": ("qwen3", {}),  # head_dim 32 != 64 / 4
    "qwen3_window": (
        "qwen3",
        {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
    ),  # layer 1 only
    "olmo2": ("olmo2", {}),
    "olmo2_kv1": ("olmo2", {"num_key_value_heads": 1}),  # TP 2 replicates the KV head
    "phi3": ("phi3", {"sliding_window": 4}),
    "phi3_longrope": (
        "phi3",
        {
            "rope_parameters": LONGROPE,
            "max_position_embeddings": 256,
            "original_max_position_embeddings": 64,
        },
    ),
    "gemma3": ("gemma3_text", {}),  # sliding layer 0, full layer 1
    "gemma3_tied_linear": (
        "gemma3_text",
        {"tie_word_embeddings": True, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    ),  # global layers' table only
    "gemma2": ("gemma2", {}),  # attention + final soft-caps
}
TP_CASES = ("qwen3", "olmo2", "olmo2_kv1", "phi3_longrope", "gemma3_tied_linear", "gemma2")


def _sequence(seed: int, n: int = 24) -> list[int]:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {
        name: build_checkpoint(root / name, arch, seed=3, **overrides)
        for name, (arch, overrides) in VARIANTS.items()
    }


def _hf(path: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=F32).eval()


def _ours(path: str, **kwargs) -> LlamaForCausalLM:
    model = load_model(path, F32, CPU, **kwargs)
    assert isinstance(model, LlamaForCausalLM)
    model.allocate_cache(4, 64)
    return model


def _extend_in_pieces(model, seq: list[int], slot: int = 1) -> torch.Tensor:
    """Logits [len(seq), V] from forward_extend calls of 7, 1, 1, 5, 1 and the rest."""
    out, start = [], 0
    for size in (7, 1, 1, 5, 1, len(seq) - 15):
        out.append(extend(model, slot, start, seq[start : start + size]))
        start += size
    return torch.cat(out)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_forward_extend_matches_hf(paths, name):
    model, ref = _ours(paths[name]), _hf(paths[name])
    seq = _sequence(0)
    want = hf_logits(ref, seq)
    torch.testing.assert_close(extend(model, 0, 0, seq), want, atol=1e-4, rtol=0)
    torch.testing.assert_close(_extend_in_pieces(model, seq), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["qwen3", "olmo2", "phi3_longrope", "gemma3", "gemma2"])
def test_step_runner_chunks_and_decode_match_hf(paths, name):
    """A 20-token prompt through StepRunner's static prefill chunks (max_step_len 4), then
    single-token and 3-token static steps, two rows at once."""
    model, ref = _ours(paths[name]), _hf(paths[name])
    runner = StepRunner(model, CPU, max_batch=4, max_step_len=4)
    seqs = [_sequence(1, 28), _sequence(2, 28)]
    wants = [hf_logits(ref, s) for s in seqs]
    for b, seq in enumerate(seqs):
        got = runner.run(torch.tensor([seq[:20]]), [b], [0], [20])
        torch.testing.assert_close(got[0, :20], wants[b][:20], atol=1e-4, rtol=0)
    start = 20
    for size in (1, 1, 3, 1):
        ids = torch.tensor([s[start : start + size] for s in seqs])
        got = runner.run(ids, [0, 1], [start] * 2, [size] * 2)
        for b in range(2):
            torch.testing.assert_close(
                got[b, :size], wants[b][start : start + size], atol=1e-4, rtol=0
            )
        start += size


def test_longrope_refuses_lengths_past_the_short_factors(paths):
    model = load_model(paths["phi3_longrope"], F32, CPU)
    assert model.rope_exact_until == 64
    with pytest.raises(ValueError, match="exceeds 64"):
        model.allocate_cache(1, 65)


def test_phi3_fused_projections_split_on_load(paths):
    model = load_model(paths["phi3"], F32, CPU)
    from safetensors.torch import load_file

    tensors = load_file(str(Path(paths["phi3"]) / "model.safetensors"))
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    qkv = tensors["model.layers.1.self_attn.qkv_proj.weight"]
    assert torch.equal(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), qkv)
    gate_up = tensors["model.layers.1.mlp.gate_up_proj.weight"]
    assert torch.equal(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), gate_up)


# ---------------------------------------------------------------- FP8


@pytest.mark.parametrize("name", ["qwen3", "olmo2", "phi3", "gemma3", "gemma2"])
def test_fp8_on_load_equals_dequantized_reference(paths, name, tmp_path):
    ours = _ours(paths[name], quantization="fp8")
    attn = ours.model.layers[0].self_attn
    assert attn.q_proj.weight.dtype == quant.FP8 and attn.qkv.fp8
    ref = _hf(fc.write_quantized_reference(paths[name], tmp_path / "ref"))
    seq = _sequence(3)
    torch.testing.assert_close(_extend_in_pieces(ours, seq), hf_logits(ref, seq), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["qwen3", "olmo2", "gemma2"])
def test_fp8_gemm_path_fused_equals_unfused(paths, name, monkeypatch):
    """The FP8 GEMM path (emulated on CPU): q/k norms keep attention off the fused route
    (OLMo 2's post-norms and Gemma's four norms keep the whole layer off it); the logits
    are those of the unfused path bit for bit."""
    monkeypatch.setattr(quant, "EMULATE_FP8_GEMM", True)
    model = load_model(paths[name], F32, CPU, quantization="fp8")
    x = torch.zeros(1, 1, model.args.hidden_size)
    layer = model.model.layers[0]
    # POST (OLMo 2) and SANDWICH (Gemma) layers never ask their attention or MLP
    placement = {"olmo2": NormPlacement.POST, "gemma2": NormPlacement.SANDWICH}
    assert layer.norms is placement.get(name, NormPlacement.PRE)
    assert layer.norms is NormPlacement.SANDWICH or not layer.self_attn.fp8_fused(x)
    out = {}
    for fuse in (False, True):
        monkeypatch.setattr(quant, "FUSE_FP8", fuse)
        model.allocate_cache(4, 64)
        out[fuse] = _extend_in_pieces(model, _sequence(4))
    assert torch.equal(out[True], out[False])


# ---------------------------------------------------------------- config checks


def test_unsupported_reason_and_config_checks(paths, tmp_path):
    import transformers

    from runtime.config import load_config as load_tandem_config
    from tests import launch

    gemma = transformers.GemmaConfig(vocab_size=96, hidden_size=64, num_hidden_layers=1)
    reason = unsupported_reason(gemma)
    assert "'gemma'" in reason and "transformers fallback" in reason and "tensor" in reason
    for name in ("qwen3", "olmo2", "phi3", "gemma3", "gemma2"):
        assert unsupported_reason(_hf_config(paths[name])) is None
        cfg = launch.write_config(
            tmp_path / f"{name}.yaml", paths[name], paths[name], ["cpu:0"], ["cpu:1", "cpu:2"]
        )
        assert load_tandem_config(cfg, check_devices=False).target.tp_size == 2


def _hf_config(path: str):
    import transformers

    return transformers.AutoConfig.from_pretrained(path)


# ---------------------------------------------------------------- TP 2 (gloo)


def _tp_child(rank: int, port: int, cases: dict, out_dir: str) -> None:
    """One rank of a 2-rank gloo world: each case's logits (one prefill of 10, then pieces)
    at TP 2, float and quantized on load."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    from parallel.groups import TPInfo

    result: dict = {}
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=120),
        )
        tp = TPInfo.from_group(dist.group.WORLD)
        for name, (path, quantization) in cases.items():
            model = load_model(path, F32, CPU, tp, quantization=quantization)
            model.allocate_cache(4, 64)
            result[name] = _extend_in_pieces(model, _sequence(5)).tolist()
        dist.barrier()
    except BaseException:  # noqa: BLE001 - reported to the parent
        result["__error__"] = traceback.format_exc()
    finally:
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
        if dist.is_initialized():
            dist.destroy_process_group()


def test_tp2_matches_hf(paths, tmp_path):
    """TP 2: split and replicated KV heads, OLMo 2's whole-q/k norms over the sharded heads
    (sum of squares all-reduced), Phi-3's fused tensors sharded, Gemma's tied vocab-parallel
    head soft-capped; FP8 at TP 2 equals FP8 at TP 1."""
    import torch.multiprocessing as mp

    from tests.launch import free_port

    cases = {name: (paths[name], None) for name in TP_CASES}
    cases.update({f"{name}_fp8": (paths[name], "fp8") for name in ("olmo2", "phi3", "gemma3")})
    ctx, port = mp.get_context("spawn"), free_port()
    procs = [
        ctx.Process(target=_tp_child, args=(r, port, cases, str(tmp_path)), daemon=True)
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
        if p.is_alive():
            p.kill()
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, res in enumerate(results):
        assert "__error__" not in res, f"rank {r} failed:\n{res['__error__']}"
    seq = _sequence(5)
    for name, (path, quantization) in cases.items():
        want = (
            hf_logits(_hf(path), seq)
            if quantization is None
            else _extend_in_pieces(_ours(path, quantization="fp8"), seq)
        )
        for res in results:
            torch.testing.assert_close(torch.tensor(res[name]), want, atol=1e-4, rtol=0)
