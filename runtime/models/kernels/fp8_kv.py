"""The FP8 KV cache in the Triton kernels (runtime.models.arch.cache.KVCache, kv_dtype "fp8").

K and V are stored as e4m3 [N+1, Hkv, BS, D] with a float32 scale per position and KV head,
k_scale / v_scale [N+1, Hkv, BS]. The writers (kernels.rope_kernel: the RoPE kernel, and
kernels.rope_rows: the write folded into attention's partial kernel) quantize each head's
row as fused.fp8_quantize_kv does: scale = max(amax, KV_AMAX_FLOOR) / 448, e4m3(x / scale),
rounded to nearest-even in float32 first (kernels.e4m3: exact under the interpreter too), so
a kernel's bytes equal the eager path's. The readers (kernels.attention_partial,
kernels.prefill_kernel) load the e4m3 values, cast them to the queries' dtype (exact: every
e4m3 value is a bf16 / fp16 value) and apply the scales in float32: K's to the scores, V's
to the probabilities before the P @ V product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.models.arch import fp8_elementwise
from runtime.models.kernels.e4m3 import e4m3_rne

FP8_MAX = tl.constexpr(fp8_elementwise.FP8_MAX)
AMAX_FLOOR = tl.constexpr(fp8_elementwise.KV_AMAX_FLOOR)


@triton.jit
def kv_scale(amax):
    """float32 amax (any shape) of a row -> its scale, max(amax, floor) / 448."""
    return tl.math.div_rn(tl.maximum(amax, AMAX_FLOOR), FP8_MAX)


@triton.jit
def kv_quantize(x, scale):
    """float32 x / scale (broadcast), clamped to +-448 and rounded to e4m3 (float8e4nv)."""
    data = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
    return e4m3_rne(data).to(tl.float8e4nv)


def scale_args(scales: tuple[torch.Tensor, ...], k_cache: torch.Tensor) -> tuple:
    """The kernels' scale arguments: (k_scale, v_scale, block stride, head stride, position
    stride) of an FP8 cache's KVCache.scales [N+1, Hkv, BS]; placeholders (k_cache's pointer,
    zero strides) for () (kv_dtype "auto": KV8 off, never read)."""
    if not scales:
        return k_cache, k_cache, 0, 0, 0
    k_scale, v_scale = scales
    if k_scale.stride() != v_scale.stride() or k_scale.shape != k_cache.shape[:3]:
        raise ValueError(
            f"KV scales {tuple(k_scale.shape)} / {tuple(v_scale.shape)} must "
            f"match the pool {tuple(k_cache.shape)} and each other's strides"
        )
    return k_scale, v_scale, *k_scale.stride()


def check_pools(k_cache: torch.Tensor, scales: tuple[torch.Tensor, ...]) -> None:
    """Raise unless the pool's dtype and the scales agree: e4m3 pools with two scales, or
    float pools with none."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8 != bool(scales) or (scales and len(scales) != 2):
        raise ValueError(
            f"a {k_cache.dtype} KV pool needs "
            f"{'(k_scale, v_scale)' if fp8 else 'no scales'}, got {len(scales)}"
        )
