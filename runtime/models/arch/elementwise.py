"""The elementwise pieces of a decoder layer in the model's dtype, each written once in plain
torch: the RMS norms, the gated activations, attention's masked softmax, and RoPE with the
KV cache writes. These are the eager versions; the model calls them through
runtime.models.arch.fused, which swaps in torch.compile'd ones on CUDA."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers' rotate_half applies it: x * cos + rotate_half(x) * sin."""
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
    write_cache(k_cache, blocks, offsets, rotate(k, cos, sin))
    write_cache(v_cache, blocks, offsets, v)
    return stack_heads(rotate(q, cos, sin), k.shape[2])


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
