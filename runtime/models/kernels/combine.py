"""The second launch of the decode / verify attention (kernels.attention.slot_attention): the
KV chunks' partial results (running max m, sum l, unnormalised output) of each query
combined into its output, a row's live chunks only (its length read on the device); or, for
the FP8 o_proj, combined and quantized per token in the same launch (combine_fp8)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.models.arch import fp8_elementwise
from runtime.models.kernels.e4m3 import e4m3_rne

FP8_MAX = tl.constexpr(fp8_elementwise.FP8_MAX)  # the largest e4m3 value
_ROUND = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def row_length(pos_ptr, valid_ptr, b, T, T_POW2: tl.constexpr):
    """Row b's attended KV length: its last valid query position + 1 (0: a padding row)."""
    ts = tl.arange(0, T_POW2)
    row_pos = tl.load(pos_ptr + b * T + ts, mask=ts < T, other=-1)
    row_valid = tl.load(valid_ptr + b * T + ts, mask=ts < T, other=0) != 0
    return tl.max(tl.where(row_valid, row_pos, -1), axis=0) + 1


@triton.jit
def live_chunks(pos_ptr, valid_ptr, b, t, T, chunk, n_chunks, T_POW2: tl.constexpr):
    """How many chunks the partial kernel wrote for query (b, t): those that start before
    the row's length; none for a padding query (its partials are empty anyway: m = -inf)."""
    n_live = tl.minimum(tl.cdiv(row_length(pos_ptr, valid_ptr, b, T, T_POW2), chunk), n_chunks)
    return tl.where(tl.load(valid_ptr + b * T + t) != 0, n_live, 0)


@triton.jit
def _combine_kernel(
    o_ptr,
    m_ptr,
    l_ptr,
    out_ptr,
    pos_ptr,
    valid_ptr,
    stride_ob,
    stride_oh,
    stride_oc,
    stride_om,
    stride_outb,
    stride_outt,
    stride_outh,
    T,
    R,
    n_chunks,
    chunk,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D: tl.constexpr,
    T_POW2: tl.constexpr,
):
    b, h, j = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # j: stacked query row
    head, t = h * R + j // T, j % T
    cs = tl.arange(0, BLOCK_C)
    dims = tl.arange(0, BLOCK_D)
    c_ok = cs < live_chunks(pos_ptr, valid_ptr, b, t, T, chunk, n_chunks, T_POW2)
    ml = (b * tl.num_programs(1) + h) * n_chunks * BLOCK_M + cs * BLOCK_M + j
    m = tl.load(m_ptr + ml, mask=c_ok, other=float("-inf"))  # [BLOCK_C]
    l_part = tl.load(l_ptr + ml, mask=c_ok, other=0.0)
    m_all = tl.max(m, axis=0)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.where(c_ok & (m > float("-inf")), tl.exp(m - m_safe), 0.0)  # [BLOCK_C]
    l_all = tl.sum(w * l_part, axis=0)
    o = tl.load(
        o_ptr
        + b * stride_ob
        + h * stride_oh
        + cs[:, None] * stride_oc
        + j * stride_om
        + dims[None, :],
        mask=c_ok[:, None] & (dims[None, :] < D),
        other=0.0,
    )  # [BLOCK_C, BLOCK_D]
    out = tl.sum(o * w[:, None], axis=0) / tl.where(l_all > 0, l_all, 1.0)
    tl.store(
        out_ptr + b * stride_outb + t * stride_outt + head * stride_outh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < D,
    )


@triton.jit
def _combine_fp8_kernel(
    o_ptr,
    m_ptr,
    l_ptr,
    data_ptr,
    scale_ptr,
    pos_ptr,
    valid_ptr,
    stride_ob,
    stride_oh,
    stride_oc,
    stride_om,
    T,
    R,
    H,
    n_chunks,
    chunk,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D: tl.constexpr,
    T_POW2: tl.constexpr,
    ROUND: tl.constexpr,
    RECIPROCAL: tl.constexpr,
):
    """One program per token (b, t): all its H query heads combined over the live chunks
    ([BLOCK_H, BLOCK_D] accumulator, a chunk a step), rounded to ROUND (q's dtype), then
    quantized per token like fused.fp8_quantize_rows."""
    b, t = tl.program_id(0), tl.program_id(1)
    heads = tl.arange(0, BLOCK_H)  # query head = KV head * R + group index
    cs = tl.arange(0, BLOCK_C)
    dims = tl.arange(0, BLOCK_D)
    h_ok, d_ok = heads < H, dims < D
    kv, j = heads // R, (heads % R) * T + t  # its KV head and stacked row
    n_live = live_chunks(pos_ptr, valid_ptr, b, t, T, chunk, n_chunks, T_POW2)
    ml0 = (b * (H // R) + kv) * n_chunks * BLOCK_M + j  # [BLOCK_H], chunk 0
    hc_ok = h_ok[:, None] & (cs[None, :] < n_live)
    m = tl.load(
        m_ptr + ml0[:, None] + cs[None, :] * BLOCK_M, mask=hc_ok, other=float("-inf")
    )  # [BLOCK_H, BLOCK_C]
    l_part = tl.load(l_ptr + ml0[:, None] + cs[None, :] * BLOCK_M, mask=hc_ok, other=0.0)
    m_all = tl.max(m, axis=1)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)  # [BLOCK_H]
    w = tl.where(hc_ok & (m > float("-inf")), tl.exp(m - m_safe[:, None]), 0.0)
    l_all = tl.sum(w * l_part, axis=1)
    o_row = o_ptr + b * stride_ob + kv * stride_oh + j * stride_om  # [BLOCK_H]
    od_ok = h_ok[:, None] & d_ok[None, :]
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for c in range(0, n_live):  # chunk by chunk: c = 0, 1, ... as _combine_kernel adds
        m_c = tl.load(m_ptr + ml0 + c * BLOCK_M, mask=h_ok, other=float("-inf"))
        w_c = tl.where(m_c > float("-inf"), tl.exp(m_c - m_safe), 0.0)
        o_c = tl.load(o_row[:, None] + c * stride_oc + dims[None, :], mask=od_ok, other=0.0)
        acc = acc + o_c * w_c[:, None]
    out = acc / tl.where(l_all > 0, l_all, 1.0)[:, None]
    out = out.to(ROUND).to(tl.float32)  # what the unfused path quantizes
    amax = tl.maximum(tl.max(tl.max(tl.abs(out), axis=1), axis=0), 1e-12)
    if RECIPROCAL:  # torch on CUDA divides by a Python scalar this way
        scale = amax * (1.0 / FP8_MAX)
    else:
        scale = tl.math.div_rn(amax, FP8_MAX)
    data = tl.minimum(tl.maximum(tl.math.div_rn(out, scale), -FP8_MAX), FP8_MAX)
    data = e4m3_rne(data)  # rounded in float32: exact under the interpreter too
    row = b * T + t
    tl.store(
        data_ptr + row * H * D + heads[:, None] * D + dims[None, :],
        data.to(tl.float8e4nv),
        mask=od_ok,
    )
    tl.store(scale_ptr + row, scale)


def combine(
    parts: tuple[torch.Tensor, ...],
    pos: torch.Tensor,
    ok: torch.Tensor,
    strides: list[int],
    seq: int,
    n_rep: int,
    chunk: int,
    dtype: torch.dtype,
    meta: dict,
) -> torch.Tensor:
    """_combine_kernel over grid (B, Hkv, r*T) -> [B, T, H, D] in `dtype`."""
    bsz, n_kv, n_chunks, _, dim = parts[0].shape
    out = torch.empty(bsz, seq, n_kv * n_rep, dim, dtype=dtype, device=parts[0].device)
    _combine_kernel[(bsz, n_kv, n_rep * seq)](
        *parts,
        out,
        pos,
        ok,
        *strides,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        seq,
        n_rep,
        n_chunks,
        chunk,
        **meta,
    )
    return out


def combine_fp8(
    parts: tuple[torch.Tensor, ...],
    pos: torch.Tensor,
    ok: torch.Tensor,
    strides: list[int],
    seq: int,
    n_rep: int,
    chunk: int,
    dtype: torch.dtype,
    meta: dict,
) -> tuple[torch.Tensor, torch.Tensor]:
    """_combine_fp8_kernel over grid (B, T) -> ([B*T, H*D] e4m3, [B*T, 1] float32).

    One program reads all of a token's live partials (H x chunks x D floats), so few tokens
    over long rows leave the combine on a few multiprocessors. lab/gpu/kernel_bench.py
    on an H200, 8b (H 32), quantize=True against the plain call plus the compiled
    fp8_quantize_heads: batch 1 at 256 positions 11.3 us against 12.3, at 1024 13.3 against
    12.6, at 4096 25.1 against 15.3; batch 16 x 5 tokens at 256 18.9 against 28.1, at 4096
    98.1 against 101.7 (70b-tp1, H 64, batch 1 at 4096: 37.8 against 16.5)."""
    bsz, n_kv, _, _, dim = parts[0].shape
    device = parts[0].device
    n_heads = n_kv * n_rep
    data = torch.empty(bsz * seq, n_heads * dim, dtype=torch.float8_e4m3fn, device=device)
    scale = torch.empty(bsz * seq, 1, dtype=torch.float32, device=device)
    block_h = triton.next_power_of_2(n_heads)
    _combine_fp8_kernel[(bsz, seq)](
        *parts,
        data,
        scale,
        pos,
        ok,
        *strides,
        seq,
        n_rep,
        n_heads,
        parts[0].shape[2],
        chunk,
        BLOCK_H=block_h,
        ROUND=_ROUND[dtype],
        RECIPROCAL=device.type == "cuda",
        num_warps=max(4, min(16, block_h * meta["BLOCK_D"] // 256)),
        **meta,
    )
    return data, scale
