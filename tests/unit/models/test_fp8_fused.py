"""The fused FP8 path (runtime.models.arch.fused *_fp8, quant.FUSE_FP8): the activation quantize and
GEMM rescale steps folded into the neighbouring elementwise kernels compute exactly what the
unfused sequence (rescale -> cast -> add -> norm -> quantize) computes: bit for bit in float32
and in bfloat16 (the same cast points), eagerly and compiled; and whole FP8 models give the
unfused FP8 path's logits. torch._scaled_mm is CUDA-only: on CPU, quant.EMULATE_FP8_GEMM runs
the FP8 GEMM path with its float32 emulation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runtime.models import load_model
from runtime.models.arch import fused, quant
from runtime.models.arch.fp8_linears import to_fp8
from runtime.models.arch.quant import FP8Act, quantize_rows
from runtime.models.runners.step_runner import StepRunner
from tests import fp8_checkpoints as fc
from tests.checkpoints import build_checkpoint
from tests.model_helpers import extend, extend_ragged

pytestmark = pytest.mark.timeout(300)

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-5
PROMPT = [1, 5, 9, 13, 17, 21, 25, 3, 44]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (e4m3 compared as bytes)."""
    if a.dtype == quant.FP8:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def gemm_out(m: int, n: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    """A raw unscaled GEMM output [M, N] float32 with its scales and bias (in dtype)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randn(m, n, generator=g) * 300
    x_scale = torch.rand(m, 1, generator=g) * 0.01 + 1e-3
    w_scale = torch.rand(n, generator=g) * 0.01 + 1e-3
    b = (torch.randn(n, generator=g) * 0.5).to(dtype) if bias else None
    return raw, x_scale, w_scale, b


def residual(m: int, k: int, dtype: torch.dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g).to(dtype), (torch.rand(k, generator=g) + 0.5).to(dtype))


# ---------------------------------------------------------------- each function


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_norms_equal_the_unfused_sequence(dtype, bias):
    x, w = residual(5, 64, dtype)
    raw, xs, ws, b = gemm_out(5, 64, dtype, bias)
    h8, hs = fused.rms_norm_fp8(x, w, EPS)
    want = fused.fp8_quantize_rows(fused.rms_norm(x, w, EPS))
    assert same(h8, want[0]) and same(hs, want[1])

    delta = fused.fp8_rescale(raw, xs, ws, b, dtype)  # o_proj's epilogue
    s, h = fused.add_rms_norm(x, delta, w, EPS)
    want8 = fused.fp8_quantize_rows(h)
    got = fused.add_rms_norm_fp8(x, raw, w, EPS, xs, ws, b)  # raw delta
    assert all(same(a, c) for a, c in zip(got, (s, *want8)))
    got = fused.add_rms_norm_fp8(x, delta, w, EPS)  # delta in dtype
    assert all(same(a, c) for a, c in zip(got, (s, *want8)))
    got = fused.rescale_add_rms_norm(x, raw, xs, ws, b, w, EPS)  # the final norm
    assert same(got[0], s) and same(got[1], h)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_silu_mul_fp8_equals_the_unfused_sequence(dtype, bias):
    raw, xs, ws, b = gemm_out(4, 96, dtype, bias)
    want = fused.fp8_quantize_rows(fused.silu_mul(fused.fp8_rescale(raw, xs, ws, b, dtype)))
    got = fused.silu_mul_fp8(raw, xs, ws, b, dtype)
    assert same(got[0], want[0]) and same(got[1], want[1])


def rotary_inputs(dtype: torch.dtype, bias: bool, bsz: int = 2, seq: int = 3):
    heads, kv, dim, slots, length = 4, 2, 16, 3, 8
    raw, xs, ws, b = gemm_out(bsz * seq, (heads + 2 * kv) * dim, dtype, bias)
    g = torch.Generator().manual_seed(2)
    angle = torch.rand(bsz, seq, dim, generator=g) * 6
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    caches = [torch.zeros(slots, kv, length, dim, dtype=dtype) for _ in range(2)]
    write_slots = torch.tensor([2, 2, 2, 0, 0, 0])
    write_pos = torch.tensor([0, 1, 2, 4, 5, 7])
    return (raw, xs, ws, b), (heads, kv, dim), (cos, sin, *caches, write_slots, write_pos)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_rotary_write_fp8_equals_the_unfused_sequence(dtype, bias):
    (raw, xs, ws, b), (heads, kv, dim), rest = rotary_inputs(dtype, bias)
    cos = rest[0]
    bsz, seq = cos.shape[:2]
    qkv = fused.fp8_rescale(raw, xs, ws, b, dtype).view(bsz, seq, -1)
    q, k, v = qkv.split([heads * dim, kv * dim, kv * dim], dim=-1)
    want_rest = [t.clone() for t in rest]
    want = fused.rotary_write(
        q.view(bsz, seq, heads, dim),
        k.view(bsz, seq, kv, dim),
        v.view(bsz, seq, kv, dim),
        *want_rest,
    )
    got = fused.rotary_write_fp8(raw, xs, ws, b, dtype, heads, kv, *rest)
    assert same(got, want)
    assert same(rest[2], want_rest[2]) and same(rest[3], want_rest[3])  # the caches
    assert rest[2].abs().sum() > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_quantize_heads_equals_reshape_then_quantize(dtype):
    g = torch.Generator().manual_seed(3)
    out = torch.randn(2, 4, 3, 16, generator=g).to(dtype).transpose(1, 2)  # [B, T, H, D]
    assert not out.is_contiguous()
    want = fused.fp8_quantize_rows(out.reshape(2, 3, 64).reshape(-1, 64))
    got = fused.fp8_quantize_heads(out)
    assert same(got[0], want[0]) and same(got[1], want[1])


def _compiled(name: str):
    return torch.compile(fused._EAGER[name], fullgraph=True, options=fused._OPTIONS[name])


@pytest.mark.timeout(600)
def test_compiled_keeps_the_eager_casts():
    """Compiled as compile_kernels compiles them (inductor, here its CPU backend), the fused
    functions still round at the unfused sequence's bf16 cast points: the eager results bit
    for bit (without emulate_precision_casts the residual sum fed to the norm is not)."""
    dtype = torch.bfloat16
    x, w = residual(5, 64, dtype)
    raw, xs, ws, b = gemm_out(5, 64, dtype, True)
    want = fused.add_rms_norm_fp8(x, raw, w, EPS, xs, ws, b)
    got = _compiled("add_rms_norm_fp8")(x, raw, w, EPS, xs, ws, b)
    assert all(same(a, c) for a, c in zip(got, want))
    raw, xs, ws, b = gemm_out(4, 96, dtype, True)
    want = fused.silu_mul_fp8(raw, xs, ws, b, dtype)
    got = _compiled("silu_mul_fp8")(raw, xs, ws, b, dtype)
    assert all(same(a, c) for a, c in zip(got, want))
    args, heads, rest = rotary_inputs(dtype, True)
    want_rest = [t.clone() for t in rest]
    want = fused.rotary_write_fp8(*args, dtype, *heads[:2], *want_rest)
    got = _compiled("rotary_write_fp8")(*args, dtype, *heads[:2], *rest)
    assert same(got, want) and same(rest[2], want_rest[2]) and same(rest[3], want_rest[3])


# ---------------------------------------------------------------- whole models


@pytest.fixture
def emulated(monkeypatch):
    """The FP8 GEMM path on CPU (float32 emulation of the unscaled _scaled_mm)."""
    monkeypatch.setattr(quant, "EMULATE_FP8_GEMM", True)


class Spy:
    """Counts the outermost calls of runtime.models.arch.fused's functions: on CUDA each is one
    compiled kernel (or two) that a step launches."""

    def __init__(self, monkeypatch):
        self.calls: dict[str, int] = {}
        self.depth = 0
        for name, fn in fused._EAGER.items():
            monkeypatch.setattr(fused, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def spy(*args, **kwargs):
            if self.depth == 0:
                self.calls[name] = self.calls.get(name, 0) + 1
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1

        return spy


def logits_both_ways(model, monkeypatch, run) -> dict[bool, list[torch.Tensor]]:
    out = {}
    for fuse in (False, True):
        monkeypatch.setattr(quant, "FUSE_FP8", fuse)
        model.allocate_cache(4, 64)
        out[fuse] = run(model)
    return out


def run_steps(model) -> list[torch.Tensor]:
    """Prefill, ragged rows, and StepRunner's static decode / verify steps."""
    out = [extend(model, 0, 0, PROMPT)]
    out += extend_ragged(model, [(1, 0, PROMPT[:4]), (2, 0, PROMPT[4:])])
    runner = StepRunner(model, CPU, max_batch=4, max_step_len=4)
    starts = [len(PROMPT), 4]
    for step in ([[7, 8, 9], [10, 11, 12]], [[4], [5]]):
        ids = torch.tensor(step)
        out.append(runner.run(ids, [0, 1], starts, [ids.shape[1]] * 2).clone())
        starts = [s + ids.shape[1] for s in starts]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_model_equals_unfused(arch, dtype, tmp_path, emulated, monkeypatch):
    """Quantize-on-load llama and Qwen2 (q/k/v bias): fused and unfused FP8 paths give the
    same logits bit for bit; outside attention the fused path runs 5 fused functions a
    layer instead of 12 (+ the final norm)."""
    path = build_checkpoint(tmp_path / arch, arch, seed=3)
    model = load_model(path, dtype, CPU, quantization="fp8")
    out = logits_both_ways(model, monkeypatch, run_steps)
    assert all(same(a, b) for a, b in zip(out[True], out[False]))
    spy = Spy(monkeypatch)
    n_layers = len(model.model.layers)
    for fuse, per_layer in ((False, 12), (True, 5)):
        monkeypatch.setattr(quant, "FUSE_FP8", fuse)
        spy.calls.clear()
        extend(model, 0, 0, PROMPT)
        assert spy.calls.pop("masked_softmax") == n_layers  # attention (not Triton here)
        assert sum(spy.calls.values()) == per_layer * n_layers + 1, spy.calls
    assert spy.calls == {
        "rms_norm_fp8": 1,
        "add_rms_norm_fp8": 2 * n_layers - 1,
        "rescale_add_rms_norm": 1,
        "rotary_write_fp8": n_layers,
        "fp8_quantize_heads": n_layers,
        "silu_mul_fp8": n_layers,
    }


def test_mixed_checkpoint_fuses_per_block(tmp_path, emulated, monkeypatch):
    """A float gate_proj in layer 1 (an ignore list): that MLP runs unfused while its attention
    is fused (the norm between them rescales without quantizing); logits unchanged."""
    float_dir = build_checkpoint(tmp_path / "llama", "llama", seed=3)
    fp8_dir, _ = fc.write_fp8(
        float_dir,
        tmp_path / "ct",
        "ct-channel-static",
        ignore=["lm_head", r"re:.*layers\.1\.mlp\.gate_proj$"],
        keep_float=("model.layers.1.mlp.gate_proj",),
    )
    model = load_model(fp8_dir, torch.bfloat16, CPU)
    x = torch.zeros(1, 1, model.args.hidden_size, dtype=torch.bfloat16)
    layer = model.model.layers[1]
    assert layer.self_attn.fp8_fused(x) and not layer.mlp.fp8_fused(x)
    out = logits_both_ways(model, monkeypatch, run_steps)
    assert all(same(a, b) for a, b in zip(out[True], out[False]))


def test_off_the_fp8_gemm_path_nothing_changes(llama_path, monkeypatch, tmp_path):
    """CPU without the emulation (the weight-only GEMM), and float models: the fused
    functions never run."""
    spy = Spy(monkeypatch)
    fp8 = load_model(llama_path, torch.bfloat16, CPU, quantization="fp8")
    plain = load_model(llama_path, torch.float32, CPU)
    for model in (fp8, plain):
        model.allocate_cache(1, 64)
        extend(model, 0, 0, PROMPT)
    assert not {k for k in spy.calls if k.endswith(("_fp8", "_heads")) or "rescale" in k}


def test_row_parallel_forward_fp8_equals_forward(emulated):
    """The row-parallel FP8 linear (TP o_proj / down_proj) on a quantized input: rescaled
    before its all-reduce (a no-op without a group), the bias after, as its forward does."""
    from parallel.layers import RowParallelLinear

    g = torch.Generator().manual_seed(5)
    w8, scale = quantize_rows(torch.randn(32, 48, generator=g))
    row = RowParallelLinear(16, 48, 32, bias=True, group=None, device="meta")
    to_fp8(row)
    row.weight = nn.Parameter(w8[:, 16:].contiguous(), requires_grad=False)
    row.weight_scale = nn.Parameter(scale, requires_grad=False)
    row.bias = nn.Parameter(torch.randn(32, generator=g).bfloat16(), requires_grad=False)
    x = torch.randn(3, 32, generator=g).bfloat16()
    x8, x_scale = fused.fp8_quantize_rows(x)
    assert same(row.forward_fp8(FP8Act(x8, x_scale, x.dtype)), row(x))


def test_row_parallel_layers_in_a_model(llama_path, emulated, monkeypatch):
    """o_proj and down_proj as (whole-input, group-less) FP8 row-parallel linears, as under
    TP: the attention and MLP fuse around them and hand rescaled [M, hidden] outputs to the
    norms; the logits equal the unfused path's."""
    from runtime.models.arch.fp8_linears import FP8RowParallelLinear

    model = load_model(llama_path, torch.bfloat16, CPU, quantization="fp8")
    for layer in model.model.layers:
        for linear in (layer.self_attn.o_proj, layer.mlp.down_proj):
            linear.__class__ = FP8RowParallelLinear
            linear.in_start, linear.in_stop, linear.group = 0, linear.in_features, None
    x = torch.zeros(1, 1, model.args.hidden_size, dtype=torch.bfloat16)
    assert model.model.layers[0].mlp.fp8_fused(x)
    out = logits_both_ways(model, monkeypatch, run_steps)
    assert all(same(a, b) for a, b in zip(out[True], out[False]))
    spy = Spy(monkeypatch)
    extend(model, 0, 0, PROMPT)
    n_layers = len(model.model.layers)
    assert spy.calls["fp8_rescale"] == 2 * n_layers and "rescale_add_rms_norm" not in spy.calls
