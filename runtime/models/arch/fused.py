"""The elementwise pieces of a decoder layer, each written once in plain torch.

Eager by default (CPU, tests). On CUDA, `compile_kernels()` swaps in torch.compile'd versions
so each piece runs as one fused kernel instead of five to ten small ones: at batch 1 a decode
step is a few hundred small kernels whose fixed cost, not the weight reads, dominated.
Callers look the functions up on this module at call time (`fused.rms_norm(...)`), so the swap
reaches every model in the process. torch.compile's default shape handling applies: the first
shape seen is compiled static (the batch-1 decode step gets kernels specialised to it), and a
dimension seen to change is then compiled dynamic, so a handful of kernels serve every batch
size, step length and KV length while the feature dimensions stay static (vectorised).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger("tandem.models")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in float32, cast back, then scale."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def unit_offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Gemma2RMSNorm / Gemma3RMSNorm: normalise and scale by (1 + weight), both
    in float32, then cast back."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): a residual add and the next norm in one pass."""
    s = x + delta
    return s, rms_norm(s, weight, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def stack_heads(q: torch.Tensor, n_kv: int) -> torch.Tensor:
    """q [B, T, H, D] -> [B, Hkv, r*T, D], r = H / Hkv: the r query heads that share a KV head
    stacked along the query axis (head h uses KV head h // r, like transformers' repeat_kv),
    so attention reads each KV head once (runtime.models.arch.attention.grouped_attention)."""
    bsz, seq, n_heads, dim = q.shape
    q = q.view(bsz, seq, n_kv, n_heads // n_kv, dim).permute(0, 2, 3, 1, 4)  # [B, Hkv, r, T, D]
    return q.reshape(bsz, n_kv, n_heads // n_kv * seq, dim)


def write_cache(
    cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, x: torch.Tensor
) -> None:
    """cache [N+1, Hkv, BS, D][block, :, offset] = x [B, T, Hkv, D] for every token, in place
    (see runtime.models.arch.cache.ExtendBatch: padding tokens go to the scratch block). The
    write indexes the cache tensor itself, not a transposed view of it: through a view,
    inductor (torch 2.11, CUDA) copied the whole cache out and back in for every write."""
    heads = torch.arange(cache.shape[1], device=cache.device)  # [Hkv]
    cache.index_put_(
        (blocks[:, None], heads[None, :], offsets[:, None]), x.flatten(0, 1).to(cache.dtype)
    )  # [B*T, Hkv, D]


def rotary_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """RoPE (transformers' rotate_half) of q [B, T, H, D] and k [B, T, Hkv, D] with cos, sin
    [B, T, D]; the rotated k and v [B, T, Hkv, D] are written to the block pools at (blocks,
    offsets) [B*T] (ExtendBatch.write_blocks / write_offsets), and q is returned with its heads
    stacked for attention
    [B, Hkv, r*T, D] (stack_heads). Compiled, the rotations, the layout change and both
    cache writes are a kernel or two (in place: torch.compile keeps the cache mutations)."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    write_cache(k_cache, blocks, offsets, _rotate(k, cos, sin))
    write_cache(v_cache, blocks, offsets, v)
    return stack_heads(_rotate(q, cos, sin), k.shape[2])


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2I] (gate | up) -> silu(gate) * up [N, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2I] (gate | up) -> gelu_tanh(gate) * up [N, I] (Gemma's GeGLU, gelu_pytorch_tanh)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def masked_softmax(
    scores: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float | None = None
) -> torch.Tensor:
    """softmax(scores * scale) over the last axis where mask allows, in float32, cast back;
    softcap c (Gemma 2): the scaled scores become c * tanh(s / c) before the mask."""
    s = scores.float() * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    return s.masked_fill(~mask, float("-inf")).softmax(dim=-1).to(scores.dtype)


FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def fp8_dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[out, in] e4m3 weight times its [out] float32 scales, computed in float32, in dtype
    (runtime.models.arch.quant: the weight-only GEMM's input)."""
    return (weight.to(torch.float32) * scale[:, None]).to(dtype)


def fp8_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> ([M, K] e4m3, [M, 1] float32): dynamic per-row (per-token) quantization,
    scale = amax / 448 of each row."""
    h = x.float()
    scale = h.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (h / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_rescale(
    out: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """An unscaled FP8 GEMM's [M, N] float32 output times its row (token) scales [M, 1] and
    column (channel) scales [N], plus the bias, in dtype."""
    out = out * x_scale * w_scale
    if bias is not None:
        out = out + bias
    return out.to(dtype)


# ---- FP8 GEMM neighbours. The CUDA FP8 GEMM (runtime.models.arch.quant) is an unscaled
# torch._scaled_mm: its input must be quantized per token and its float32 output rescaled.
# The functions below fold those two steps into the elementwise kernels beside the GEMM. Each
# is the unfused sequence itself (rescale -> cast to dtype -> add -> norm -> quantize), built
# from the eager pieces above (private aliases: compile_kernels never swaps them), so eager
# results are bit for bit the unfused ones; compiled, `_PRECISE` keeps every low-precision
# cast of that sequence (see compile_kernels).

_rms_norm, _add_rms_norm, _rotary_write, _silu_mul = rms_norm, add_rms_norm, rotary_write, silu_mul
_quantize, _rescale = fp8_quantize_rows, fp8_rescale


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> rms_norm(x) quantized per token for the next FP8 GEMM: ([M, K] e4m3,
    [M, 1] float32). The first layer's input norm."""
    return _quantize(_rms_norm(x, weight, eps))


def add_rms_norm_fp8(
    x: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] + delta -> (x + delta [M, K], its rms_norm quantized: [M, K] e4m3, [M, 1]).
    delta [M, K] is in x.dtype, or with x_scale [M, 1] and w_scale [K] given, the raw float32
    output of the previous unscaled FP8 GEMM (o_proj, down_proj), rescaled (+ bias) and cast
    to x.dtype first as fp8_rescale does: that GEMM's epilogue folded into the next norm."""
    if x_scale is not None:
        assert w_scale is not None, "x_scale and w_scale come together"
        delta = _rescale(delta, x_scale, w_scale, bias, x.dtype)
    s = x + delta
    return (s, *_quantize(_rms_norm(s, weight, eps)))


def rescale_add_rms_norm(
    x: torch.Tensor,
    raw: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm(x [M, K], raw [M, K] rescaled and cast to x.dtype): the last down_proj's
    epilogue folded into the final norm (whose consumer, the LM head, stays float)."""
    return _add_rms_norm(x, _rescale(raw, x_scale, w_scale, bias, x.dtype), weight, eps)


def silu_mul_fp8(
    raw: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The raw gate_up GEMM output [M, 2I] float32 -> rescaled (+ bias) and cast to dtype,
    silu(gate) * up in dtype, quantized per token for down_proj: ([M, I] e4m3, [M, 1])."""
    return _quantize(_silu_mul(_rescale(raw, x_scale, w_scale, bias, dtype)))


def rotary_write_fp8(
    raw: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    n_heads: int,
    n_kv: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """rotary_write of the raw q/k/v GEMM output [B*T, (H + 2 Hkv) D] float32, rescaled
    (+ bias) and cast to dtype first: the qkv epilogue folded into RoPE and the cache writes.
    cos, sin [B, T, D]; returns q [B, Hkv, r*T, D] like rotary_write."""
    bsz, seq, dim = cos.shape
    qkv = _rescale(raw, x_scale, w_scale, bias, dtype).view(bsz, seq, -1)
    q, k, v = qkv.split([n_heads * dim, n_kv * dim, n_kv * dim], dim=-1)
    return _rotary_write(
        q.view(bsz, seq, n_heads, dim),
        k.view(bsz, seq, n_kv, dim),
        v.view(bsz, seq, n_kv, dim),
        cos,
        sin,
        k_cache,
        v_cache,
        blocks,
        offsets,
    )


def fp8_quantize_heads(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention's output [B, T, H, D] -> o_proj's input quantized per token: ([B*T, H*D]
    e4m3, [B*T, 1]); the layout copy (the attention output may be strided) folded in."""
    return _quantize(out.reshape(out.shape[0] * out.shape[1], -1))


# ---- FP8 KV cache (runtime.models.arch.cache.KVCache, kv_dtype "fp8"): K and V stored as
# e4m3 with a float32 scale per position and KV head. The writes below are rotary_write and
# rotary_write_fp8 with each head's row quantized on its way into the pools.

KV_AMAX_FLOOR = 1e-12  # the smallest amax a KV scale is taken of: an all-zero row stores 0s


def fp8_quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] -> ([..., D] e4m3, [...] float32): per-row (one position of one KV head)
    quantization, scale = max(amax(|x|), KV_AMAX_FLOOR) / 448; x ~ e4m3.float() * scale."""
    h = x.float()
    scale = h.abs().amax(-1).clamp(min=KV_AMAX_FLOOR) / FP8_MAX
    return (h / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def write_cache_kv8(
    cache: torch.Tensor,
    scales: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    x: torch.Tensor,
) -> None:
    """write_cache into an FP8 pool: x [B, T, Hkv, D] quantized per (token, head)
    (fp8_quantize_kv), e4m3 into cache [N+1, Hkv, BS, D] and the scales into scales
    [N+1, Hkv, BS] at (blocks, offsets) [B*T]."""
    heads = torch.arange(cache.shape[1], device=cache.device)  # [Hkv]
    data, scale = fp8_quantize_kv(x.flatten(0, 1))  # [B*T, Hkv, D], [B*T, Hkv]
    at = (blocks[:, None], heads[None, :], offsets[:, None])
    cache.index_put_(at, data)
    scales.index_put_(at, scale)


def rotary_write_kv8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> torch.Tensor:
    """rotary_write into FP8 pools: k rotated (rounded to q's dtype) and v quantized per
    (token, head) into k_cache / v_cache [N+1, Hkv, BS, D] e4m3 and k_scale / v_scale
    [N+1, Hkv, BS] float32 -> q [B, Hkv, r*T, D] like rotary_write."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    write_cache_kv8(k_cache, k_scale, blocks, offsets, _rotate(k, cos, sin))
    write_cache_kv8(v_cache, v_scale, blocks, offsets, v)
    return stack_heads(_rotate(q, cos, sin), k.shape[2])


_rotary_write_kv8 = rotary_write_kv8  # the eager one (compile_kernels swaps the public name)


def rotary_write_fp8_kv8(
    raw: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    n_heads: int,
    n_kv: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> torch.Tensor:
    """rotary_write_fp8 (the raw qkv GEMM output [B*T, (H + 2 Hkv) D] float32, rescaled and
    cast to dtype) into FP8 pools, as rotary_write_kv8 -> q [B, Hkv, r*T, D]."""
    bsz, seq, dim = cos.shape
    qkv = _rescale(raw, x_scale, w_scale, bias, dtype).view(bsz, seq, -1)
    q, k, v = qkv.split([n_heads * dim, n_kv * dim, n_kv * dim], dim=-1)
    return _rotary_write_kv8(
        q.view(bsz, seq, n_heads, dim),
        k.view(bsz, seq, n_kv, dim),
        v.view(bsz, seq, n_kv, dim),
        cos,
        sin,
        k_cache,
        v_cache,
        blocks,
        offsets,
        k_scale,
        v_scale,
    )


_EAGER = {
    fn.__name__: fn
    for fn in (
        rms_norm,
        add_rms_norm,
        rotary_write,
        silu_mul,
        masked_softmax,
        unit_offset_rms_norm,
        gelu_tanh_mul,
        fp8_dequantize,
        fp8_quantize_rows,
        fp8_rescale,
        rms_norm_fp8,
        add_rms_norm_fp8,
        rescale_add_rms_norm,
        silu_mul_fp8,
        rotary_write_fp8,
        fp8_quantize_heads,
        rotary_write_kv8,
        rotary_write_fp8_kv8,
    )
}
# inductor options per function: the FP8 neighbours keep eager's bf16/fp16 roundings (by
# default inductor elides a downcast-upcast pair between two fused ops, and contracts
# multiply-adds), so fused and unfused sequences round at the same points
_PRECISE: dict[str, str | int | bool | Callable[..., Any]] = {"emulate_precision_casts": True}
_OPTIONS = {
    name: _PRECISE
    for name in (
        "rms_norm_fp8",
        "add_rms_norm_fp8",
        "rescale_add_rms_norm",
        "silu_mul_fp8",
        "rotary_write_fp8",
        "fp8_quantize_heads",
        "rotary_write_fp8_kv8",
    )
}
_compiled = False


def _probe(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return silu_mul(x) * weight + 1.0


def _check_compiler(device: torch.device) -> None:
    """Compile and run a small function: torch.compile compiles lazily, so a missing compiler
    would otherwise surface in the middle of a request. (A separate function: calling the
    real ones at toy shapes would make torch.compile treat every dimension as dynamic.)"""
    x = torch.randn(2, 8, device=device, dtype=torch.bfloat16)
    torch.compile(_probe, fullgraph=True)(x, torch.ones(4, device=device, dtype=x.dtype))


def pdl_supported(device: torch.device) -> bool:
    """Whether the compiled pieces launch with programmatic dependent launch (PDL) on
    `device`: a CUDA device of compute capability 9.0 or later.

    With PDL a kernel is launched while the one before it still runs and waits on the device
    (griddepcontrol.wait) for its results: launch and ramp-up overlap the previous kernel's
    tail (inductor's `triton.enable_pdl` writes the waits). Measured on an H200 with
    lab/gpu/step_ab.py: 8b steps 0.3-0.9% faster, logits the same bit for bit
    (docs/benchmarks.md)."""
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def _inductor_pdl(device: torch.device) -> None:
    """Set inductor's PDL switch by pdl_supported, unless TORCHINDUCTOR_ENABLE_PDL (its own
    variable) is set or this torch has no such switch."""
    import torch._inductor.config as inductor_config

    if "TORCHINDUCTOR_ENABLE_PDL" not in os.environ and hasattr(
        inductor_config.triton, "enable_pdl"
    ):
        inductor_config.triton.enable_pdl = pdl_supported(device)


def compile_kernels(device: torch.device) -> bool:
    """Replace this module's functions by torch.compile'd ones (once per process) and compile
    them on `device`. Returns whether they are compiled; on failure (no C compiler, no triton)
    the eager ones stay and a warning says why."""
    global _compiled
    if _compiled:
        return True
    try:
        _inductor_pdl(device)
        _check_compiler(device)
        for name in ("recompile_limit", "cache_size_limit"):  # shapes: see the docstring
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))
        globals().update(
            {
                name: torch.compile(fn, fullgraph=True, options=_OPTIONS.get(name))
                for name, fn in _EAGER.items()
            }
        )
    except Exception as exc:  # noqa: BLE001 - fall back to eager, say why
        globals().update(_EAGER)
        log.warning(
            "torch.compile failed, decoder pieces stay eager: %s: %s", type(exc).__name__, exc
        )
        return False
    _compiled = True
    return True


def use_eager() -> None:
    """Undo compile_kernels (tests)."""
    global _compiled
    globals().update(_EAGER)
    _compiled = False
