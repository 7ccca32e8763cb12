"""Grouped-query self-attention over the paged KV cache (runtime.models.arch.cache).

Shapes are local: `n_heads`, `n_kv_heads` and `head_dim` are plain attributes read at every
call, so tensor parallelism can shard q/k/v/o_proj from outside and divide the head counts.
This module holds no collectives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, overload

import torch
import torch.nn.functional as F
from torch import nn

from runtime.models import kernels
from runtime.models.arch import fused
from runtime.models.arch.cache import ExtendBatch, KVCache
from runtime.models.arch.model_args import ModelArgs
from runtime.models.arch.norms import norm_class
from runtime.models.arch.quant import FP8Act, FP8Mixin, FP8Out, RowStack, fuses_fp8, stack_rows

if TYPE_CHECKING:  # Triton's module: imported where the kernels run
    from runtime.models.kernels.rope import NewTokens

SMALL_QUERY = 64  # up to this many query rows per KV head: explicit matmul-softmax-matmul
SLOT_KERNEL_ROWS = 128  # up to this many: the Triton kernel over the cache (when enabled)
PREFILL_KERNEL_MAX_DIM = 256  # more rows: the prefill kernel, for head_dims up to this


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.sliding_window = args.layer_windows[layer_idx] if args.layer_windows else None
        self.scale = args.attn_scale or args.head_dim**-0.5  # of q.k (Gemma: its own)
        self.softcap = args.attn_softcap  # Gemma 2: scores capped at c * tanh(s / c)
        q_dim, kv_dim = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, q_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.hidden_size, kv_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.hidden_size, kv_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(q_dim, args.hidden_size, bias=args.o_bias)
        self.kv_cache: KVCache | None = None
        self.qkv: RowStack | None = None  # set by fuse_projections
        self.qk_norm = args.qk_norm  # model_args.QK_NORM: q/k normed before RoPE
        if args.qk_norm is not None:  # "head": weight [D]; "full": [H*D] and [Hkv*D]
            per_head = args.qk_norm == "head"
            eps, norm = args.rms_norm_eps, norm_class(args)
            # an RMSNorm, or over a TP shard of the projection parallel.layers.ParallelRMSNorm
            self.q_norm: nn.Module = norm(args.head_dim if per_head else q_dim, eps)
            self.k_norm: nn.Module = norm(args.head_dim if per_head else kv_dim, eps)

    def fuse_projections(self) -> None:
        """One GEMM for q, k and v (float or FP8); their weights become views of it."""
        self.qkv = stack_rows(self.q_proj, self.k_proj, self.v_proj)

    def allocate_cache(
        self,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        kv_dtype: str = "auto",
    ) -> None:
        """A pool of num_blocks blocks of block_size positions (+ the scratch block), K and V
        in `dtype` on `device`: the model's activation dtype (default: that of q_proj's
        weight, which an FP8 model does not have, so LlamaForCausalLM passes it); with
        kv_dtype "fp8" in e4m3 with per-position scales instead (cache.KVCache)."""
        ref = self.q_proj.weight  # device of the (possibly sharded) weights
        self.kv_cache = KVCache(
            num_blocks,
            block_size,
            self.n_kv_heads,
            self.head_dim,
            dtype=dtype or ref.dtype,
            device=device or ref.device,
            kv_dtype=kv_dtype,
        )

    def fp8_fused(self, x: torch.Tensor) -> bool:
        """Whether forward takes an FP8Act (quant.fuses_fp8): FP8 GEMMs for qkv and o_proj.
        Not with q/k norms: they sit between the qkv GEMM and the RoPE kernel that would
        rescale its raw output (those layers take the unfused FP8 GEMMs instead)."""
        return self.qk_norm is None and fuses_fp8(x, self.qkv, self.o_proj)

    def forward(
        self, x: torch.Tensor | FP8Act, cos: torch.Tensor, sin: torch.Tensor, batch: ExtendBatch
    ) -> torch.Tensor | FP8Out:
        """x [B, T, hidden] -> [B, T, hidden]; cos, sin [B, T, D]. On the fused FP8 path
        (fp8_fused) x is the FP8Act of [B*T, hidden], the qkv rescale folds into RoPE and
        the cache writes, and o_proj's output comes back raw (FP8Out [B*T, hidden]; under
        TP rescaled and all-reduced, [B*T, hidden])."""
        if self.kv_cache is None:
            raise RuntimeError("allocate_cache() must be called before forward_extend()")
        if isinstance(x, FP8Act):
            return self._forward_fp8(x, cos, sin, batch)
        bsz, seq, _ = x.shape
        h, h_kv, d = self.n_heads, self.n_kv_heads, self.head_dim
        if self.qkv is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = self.qkv(x).split([h * d, h_kv * d, h_kv * d], dim=-1)
        if self.qk_norm is not None:
            q, k = self._norm_qk(q, k, d)
        cache = self.kv_cache
        q, k, v = q.view(bsz, seq, h, d), k.view(bsz, seq, h_kv, d), v.view(bsz, seq, h_kv, d)
        if self._folds_rope(seq) and rope_kernel().fits(q, k, v, cos, sin):
            q = rope_kernel().new_tokens(q, k, v, cos, sin)  # rotated in attention's kernel
        else:
            q = rotary_write(
                q,
                k,
                v,
                cos,
                sin,
                cache.k_cache,
                cache.v_cache,
                batch.write_blocks,
                batch.write_offsets,
                scales=cache.scales,
            )  # [B, Hkv, r*T, D]
        out = self._attend(q, batch, seq)  # [B, T, H, D]
        return self.o_proj(out.reshape(bsz, seq, self.n_heads * self.head_dim))

    def _norm_qk(
        self, q: torch.Tensor, k: torch.Tensor, d: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, T, H*D], k [B, T, Hkv*D] normed before RoPE (so also before the kernels that
        fold RoPE into attention): over each head's D values (Qwen3) or over the whole
        projection (OLMo 2; under TP the plan's norm sums the squares over the group)."""
        if self.qk_norm == "head":
            return (
                self.q_norm(q.unflatten(-1, (-1, d))).flatten(-2),
                self.k_norm(k.unflatten(-1, (-1, d))).flatten(-2),
            )
        return self.q_norm(q), self.k_norm(k)

    def _forward_fp8(
        self, x: FP8Act, cos: torch.Tensor, sin: torch.Tensor, batch: ExtendBatch
    ) -> FP8Out | torch.Tensor:
        cache = self.kv_cache
        assert cache is not None and self.qkv is not None  # forward's; fp8_fused's
        assert isinstance(self.o_proj, FP8Mixin)  # fp8_fused
        qkv = self.qkv.forward_fp8(x)  # raw [M, (H+2Hkv)D]
        args = (*qkv, x.dtype, self.n_heads, self.n_kv_heads, cos, sin)
        if self._folds_rope(cos.shape[1]) and rope_kernel().fits_fp8(*qkv, self.head_dim, cos, sin):
            q = rope_kernel().new_tokens_fp8(*args)  # rescaled and rotated in attention
        else:
            q = rotary_write_fp8(
                *args,
                cache.k_cache,
                cache.v_cache,
                batch.write_blocks,
                batch.write_offsets,
                scales=cache.scales,
            )  # [B, Hkv, r*T, D]
        out8, out_scale = self._attend(q, batch, cos.shape[1], quantize=True)  # [M, H*D], [M, 1]
        return self.o_proj.forward_fp8(FP8Act(out8, out_scale, x.dtype))  # [M, hidden]

    def _folds_rope(self, seq: int) -> bool:
        """Whether the Triton attention kernel attends this step and also rotates its q/k
        and writes its new k/v (for steps of kernels.attention.FOLD_ROPE_MIN_SEQ tokens or
        more, a head_dim it takes): then the separate RoPE kernel is not launched."""
        if not (kernels.enabled() and self._slot_kernel(seq)):
            return False
        from runtime.models.kernels import attention as kernel

        return seq >= kernel.FOLD_ROPE_MIN_SEQ and kernel.fits_head_dim(self.head_dim)

    def _slot_kernel(self, seq: int) -> bool:
        """Whether _attend uses the Triton kernel for a step of seq tokens a row."""
        return self.n_heads // self.n_kv_heads * seq <= SLOT_KERNEL_ROWS

    @overload
    def _attend(
        self,
        q: torch.Tensor | NewTokens,
        batch: ExtendBatch,
        seq: int,
        quantize: Literal[False] = False,
    ) -> torch.Tensor: ...

    @overload
    def _attend(
        self, q: torch.Tensor | NewTokens, batch: ExtendBatch, seq: int, quantize: Literal[True]
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def _attend(
        self, q: torch.Tensor | NewTokens, batch: ExtendBatch, seq: int, quantize: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """q [B, Hkv, r*T, D] (stacked: elementwise.stack_heads) over the cache -> [B, T, H, D];
        or the step's kernels.rope.NewTokens (only where _folds_rope said so). With the
        kernels on: steps of up to SLOT_KERNEL_ROWS stacked rows take the flash-decoding
        kernel, longer ones (prompt chunks) the flash-attention prefill kernel; without them
        (CPU), grouped_attention over the gathered cache.
        quantize: o_proj's FP8 input instead ([B*T, H*D] e4m3, [B*T, 1]), quantized in the
        attention kernel's combine where that pays (kernels.attention.fp8_combine_pays), else
        by fused.fp8_quantize_heads after it."""
        cache = self.kv_cache
        assert cache is not None  # forward's
        logits = dict(scale=self.scale, softcap=self.softcap)  # per layer (Gemma)
        if kernels.enabled() and self._slot_kernel(seq):
            from runtime.models.kernels.attention import fp8_combine_pays

            in_combine = quantize and fp8_combine_pays(q, batch.capacity, seq)
            out = slot_attention(
                q,
                cache.k_cache,
                cache.v_cache,
                batch.block_table,
                *batch.int32_rows(),
                seq,
                self.sliding_window,
                quantize=in_combine,
                kv_scales=cache.scales,
                **logits,
            )
            if in_combine:
                return out
            assert isinstance(out, torch.Tensor)  # not quantized in the combine
        elif kernels.enabled() and prefill_kernel().fits(q, cache.k_cache, cache.scales):
            out = prefill_kernel().prefill_attention(
                q,
                cache.k_cache,
                cache.v_cache,
                batch.block_table,
                *batch.int32_rows(),
                self.sliding_window,
                kv_scales=cache.scales,
                **logits,
            )  # [B, T, H, D]
        else:
            assert isinstance(q, torch.Tensor)  # NewTokens only where the kernels run
            k_all, v_all = cache.read(batch)  # gathered (dequantized) [B, Hkv, L, D]
            out = grouped_attention(q, k_all, v_all, batch.mask(self.sliding_window), seq, **logits)
        return fused.fp8_quantize_heads(out) if quantize else out


def rope_kernel():
    """runtime.models.kernels.rope, imported on first use (Triton)."""
    from runtime.models.kernels import rope

    return rope


def prefill_kernel():
    """runtime.models.kernels.prefill_attention, imported on first use (Triton): the
    flash-attention kernel of steps too long for the slot kernel (prompt chunks)."""
    from runtime.models.kernels import prefill_attention

    return prefill_attention


def rotary_write(*args, scales: tuple = ()) -> torch.Tensor:
    """runtime.models.kernels.rope.rotary_write (one Triton kernel) when the kernels are on and
    it takes these tensors, else fused.rotary_write (same arguments). scales: an FP8 cache's
    KVCache.scales (the kernel's trailing arguments, or fused.rotary_write_kv8's)."""
    if kernels.enabled() and rope_kernel().fits(*args[:5]):
        return rope_kernel().rotary_write(*args, *scales)
    if scales:
        return fused.rotary_write_kv8(*args, *scales)
    return fused.rotary_write(*args)


def rotary_write_fp8(*args, scales: tuple = ()) -> torch.Tensor:
    """runtime.models.kernels.rope.rotary_write_fp8 (one Triton kernel) when the kernels are
    on and it takes these tensors, else fused.rotary_write_fp8 (same arguments); scales as
    rotary_write's (fused.rotary_write_fp8_kv8)."""
    if kernels.enabled():
        raw, x_scale, w_scale, bias, cos, sin = *args[:4], *args[7:9]
        if rope_kernel().fits_fp8(raw, x_scale, w_scale, bias, cos.shape[-1], cos, sin):
            return rope_kernel().rotary_write_fp8(*args, *scales)
    if scales:
        return fused.rotary_write_fp8_kv8(*args, *scales)
    return fused.rotary_write_fp8(*args)


def slot_attention(*args, **kwargs) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """runtime.models.kernels.attention.slot_attention, imported on first use (Triton)."""
    from runtime.models.kernels.attention import slot_attention as kernel

    return kernel(*args, **kwargs)


def grouped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    seq: int,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Grouped-query attention without copying keys/values per query head.

    q [B, Hkv, r*T, D] (the r = H / Hkv query heads of each KV head stacked along the query
    axis: elementwise.stack_heads); k, v [B, Hkv, L, D]; mask [B, 1, T, L] bool -> [B, T, H, D].
    Attention reads each KV head once; every query row has its own softmax, so stacking
    changes nothing. scale: of the scores (default D ** -0.5); softcap c: scaled scores
    capped at c * tanh(s / c) before the mask (Gemma 2; SDPA has no such step, so capped
    layers always take the explicit softmax)."""
    bsz, n_kv, rows, dim = q.shape
    n_rep, n_heads = rows // seq, rows // seq * n_kv
    length = mask.shape[-1]
    scale = dim**-0.5 if scale is None else scale
    if n_rep * seq <= SMALL_QUERY or softcap is not None:  # decode / verify (short KV)
        scores = torch.matmul(q, k.transpose(-1, -2))  # [B, Hkv, r*T, L]
        probs = fused.masked_softmax(
            scores.view(bsz, n_kv, n_rep, seq, length), mask[:, :, None], scale, softcap
        )  # [B, Hkv, r, T, L]
        out = torch.matmul(probs.view(bsz, n_kv, n_rep * seq, length), v)  # [B, Hkv, r*T, D]
    else:
        mask = mask[:, :, None].expand(bsz, 1, n_rep, seq, length)  # [B, 1, r, T, L]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask.reshape(bsz, 1, n_rep * seq, length), scale=scale
        )  # [B, Hkv, r*T, D]
    out = out.view(bsz, n_kv, n_rep, seq, dim).permute(0, 3, 1, 2, 4)  # [B, T, Hkv, r, D]
    return out.reshape(bsz, seq, n_heads, dim)
