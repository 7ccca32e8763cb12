"""The elementwise pieces of the FP8 paths, in plain torch: quantizing activations and
rescaling the output around an FP8 GEMM, those steps folded into the neighbouring norms,
activation and RoPE, and the writes into an FP8 KV cache. These are the eager versions; the
model calls them through runtime.models.arch.fused, which swaps in torch.compile'd ones on
CUDA (keeping every low-precision cast: fused._PRECISE)."""

from __future__ import annotations

import torch

from runtime.models.arch.elementwise import (
    add_rms_norm,
    rms_norm,
    rotary_write,
    rotate,
    silu_mul,
    stack_heads,
)

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
# from the eager pieces (fused.compile_kernels swaps only fused's names, never these), so eager
# results are bit for bit the unfused ones; compiled, fused._PRECISE keeps every low-precision
# cast of that sequence.


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> rms_norm(x) quantized per token for the next FP8 GEMM: ([M, K] e4m3,
    [M, 1] float32). The first layer's input norm."""
    return fp8_quantize_rows(rms_norm(x, weight, eps))


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
        delta = fp8_rescale(delta, x_scale, w_scale, bias, x.dtype)
    s = x + delta
    return (s, *fp8_quantize_rows(rms_norm(s, weight, eps)))


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
    return add_rms_norm(x, fp8_rescale(raw, x_scale, w_scale, bias, x.dtype), weight, eps)


def silu_mul_fp8(
    raw: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The raw gate_up GEMM output [M, 2I] float32 -> rescaled (+ bias) and cast to dtype,
    silu(gate) * up in dtype, quantized per token for down_proj: ([M, I] e4m3, [M, 1])."""
    return fp8_quantize_rows(silu_mul(fp8_rescale(raw, x_scale, w_scale, bias, dtype)))


def _split_qkv(
    raw: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    n_heads: int,
    n_kv: int,
    cos: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The raw q/k/v GEMM output [B*T, (H + 2 Hkv) D] float32, rescaled (+ bias) and cast to
    dtype -> q [B, T, H, D], k and v [B, T, Hkv, D] (B, T, D from cos [B, T, D])."""
    bsz, seq, dim = cos.shape
    qkv = fp8_rescale(raw, x_scale, w_scale, bias, dtype).view(bsz, seq, -1)
    q, k, v = qkv.split([n_heads * dim, n_kv * dim, n_kv * dim], dim=-1)
    return (
        q.view(bsz, seq, n_heads, dim),
        k.view(bsz, seq, n_kv, dim),
        v.view(bsz, seq, n_kv, dim),
    )


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
    q, k, v = _split_qkv(raw, x_scale, w_scale, bias, dtype, n_heads, n_kv, cos)
    return rotary_write(q, k, v, cos, sin, k_cache, v_cache, blocks, offsets)


def fp8_quantize_heads(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention's output [B, T, H, D] -> o_proj's input quantized per token: ([B*T, H*D]
    e4m3, [B*T, 1]); the layout copy (the attention output may be strided) folded in."""
    return fp8_quantize_rows(out.reshape(out.shape[0] * out.shape[1], -1))


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
    write_cache_kv8(k_cache, k_scale, blocks, offsets, rotate(k, cos, sin))
    write_cache_kv8(v_cache, v_scale, blocks, offsets, v)
    return stack_heads(rotate(q, cos, sin), k.shape[2])


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
    q, k, v = _split_qkv(raw, x_scale, w_scale, bias, dtype, n_heads, n_kv, cos)
    return rotary_write_kv8(q, k, v, cos, sin, k_cache, v_cache, blocks, offsets, k_scale, v_scale)
