"""Paged KV cache (a block pool per layer) and the per-call batch layout shared by all layers.

Each attention layer owns one KVCache: a pool of fixed-size blocks of `block_size` positions.
A row of a call addresses the pool through its block table [max_blocks_per_seq] int32: its
position p lives in block table[p // block_size] at offset p % block_size. The caller keeps
the rows' lengths and builds their tables (runtime.worker: today a fixed table per slot,
`slot_block_table`; the rank-0 block manager replaces it). Rollback needs no work here:
positions >= start_pos of a row are simply overwritten by the next forward_extend before
any query can attend to them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

KV_DTYPES = ("auto", "fp8")  # runtime.kv_cache_dtype: the activation dtype, or e4m3 + scales


def blocks_for(positions: int, block_size: int) -> int:
    """Blocks that hold `positions` positions: ceil(positions / block_size)."""
    return -(-positions // block_size)


def slot_block_table(slots: Sequence[int], blocks_per_seq: int) -> list[list[int]]:
    """The fixed block tables of slots [B] -> [B][blocks_per_seq]: slot s owns blocks
    s * M .. s * M + M - 1 (M = blocks_per_seq), the same capacity as a slot cache had.
    The one place this mapping lives until rank 0 allocates blocks (issue 35)."""
    return [list(range(s * blocks_per_seq, (s + 1) * blocks_per_seq)) for s in slots]


def as_block_table(rows, blocks_per_seq: int, device: torch.device) -> torch.Tensor:
    """rows: block tables [B, M] (a tensor or lists), or slots [B] (a tensor or ints: their
    fixed tables, slot_block_table) -> an int32 [B, M] tensor on `device`."""
    if not isinstance(rows, torch.Tensor):
        rows = list(rows)
        if rows and isinstance(rows[0], int):
            rows = slot_block_table(rows, blocks_per_seq)
        rows = torch.tensor(rows, dtype=torch.int32)
    elif rows.dim() == 1:
        rows = torch.tensor(slot_block_table(rows.tolist(), blocks_per_seq), dtype=torch.int32)
    return rows.to(device=device, dtype=torch.int32)


class KVCache(nn.Module):
    """Keys and values of one layer: a pool of `num_blocks` blocks of `block_size` positions.

    Storage is [num_blocks + 1, n_kv_heads, block_size, head_dim]: a block's heads are
    contiguous runs of positions (the Triton kernels read BLOCK_N positions of one head as
    whole rows). Block num_blocks (`scratch`) absorbs the padding tokens of a ragged batch,
    so writing needs no host sync and never touches valid data.

    kv_dtype "auto": K and V in `dtype` (the activation dtype). "fp8": K and V in e4m3 and
    a float32 scale per position and KV head, k_scale / v_scale [num_blocks + 1, n_kv_heads,
    block_size]: amax(|x|) / 448 over head_dim (fp8_elementwise.fp8_quantize_kv); a value is
    e4m3.float() * scale. Half the bytes of bf16 K/V plus 8 bytes a position and KV head.
    """

    # buffers (register_buffer)
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None  # None unless fp8
    v_scale: torch.Tensor | None

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        kv_dtype: str = "auto",
    ):
        super().__init__()
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype, self.kv_dtype = dtype, kv_dtype
        shape = self.shape(num_blocks, block_size, n_kv_heads, head_dim)
        store = torch.float8_e4m3fn if self.fp8 else dtype
        for name in ("k_cache", "v_cache"):
            self.register_buffer(
                name, torch.zeros(shape, dtype=store, device=device), persistent=False
            )
        for name in ("k_scale", "v_scale"):  # None unless fp8
            scale = torch.zeros(shape[:3], dtype=torch.float32, device=device) if self.fp8 else None
            self.register_buffer(name, scale, persistent=False)

    @property
    def fp8(self) -> bool:
        """Whether K and V are stored in e4m3 with per-position scales (kv_dtype "fp8")."""
        return self.kv_dtype == "fp8"

    @property
    def scales(self) -> tuple[torch.Tensor, ...]:
        """(k_scale, v_scale) [N+1, Hkv, BS] float32 of an FP8 cache; () otherwise: the
        trailing arguments of the write and attention calls."""
        if not self.fp8:
            return ()
        assert self.k_scale is not None and self.v_scale is not None
        return (self.k_scale, self.v_scale)

    @staticmethod
    def position_bytes(
        n_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_dtype: str = "auto"
    ) -> int:
        """Bytes one position costs in one layer: K and V of every KV head, in `dtype`
        ("auto") or e4m3 plus their two float32 scales ("fp8")."""
        if kv_dtype == "fp8":
            return 2 * n_kv_heads * (head_dim + 4)
        if kv_dtype != "auto":
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
        return 2 * n_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def scratch(self) -> int:
        """The block padding tokens write to."""
        return self.num_blocks

    @staticmethod
    def shape(
        num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int
    ) -> tuple[int, int, int, int]:
        """Shape of k_cache and of v_cache (the scratch block included)."""
        return (num_blocks + 1, n_kv_heads, block_size, head_dim)

    def read(self, batch: ExtendBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """This batch's keys and values [B, Hkv, L, D] in `dtype`, L = kv_len: each row's
        first ceil(L / block_size) blocks gathered in table order (a copy; an FP8 cache's
        dequantized in float32: e4m3 * scale). (Writing is fused with RoPE:
        runtime.models.arch.fused.rotary_write, rotary_write_kv8.)"""
        n = blocks_for(batch.kv_len, self.block_size)
        table, length = batch.block_table[:, :n].long(), batch.kv_len  # [B, n]
        if not self.fp8:
            return _rows_of(self.k_cache, table, length), _rows_of(self.v_cache, table, length)
        k_scale, v_scale = self.scales

        def dequantized(cache: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            rows = _rows_of(cache, table, length).float()
            return (rows * _rows_of(scale[..., None], table, length)).to(self.dtype)

        return dequantized(self.k_cache, k_scale), dequantized(self.v_cache, v_scale)


def _rows_of(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """cache [N+1, H, BS, D] gathered by table [B, n] -> [B, H, length, D] (D = 1: scales
    [N+1, H, BS, 1])."""
    bsz, n = table.shape
    _, heads, block, dim = cache.shape
    blocks = cache[table]  # [B, n, H, BS, D]
    rows = blocks.permute(0, 2, 1, 3, 4).reshape(bsz, heads, n * block, dim)
    return rows[:, :, :length]


@dataclass
class ExtendBatch:
    """Layout of one forward_extend call, computed once and shared by every layer."""

    block_table: torch.Tensor  # [B, M] int32 block of each row's logical block
    positions: torch.Tensor  # [B, T] absolute position of each token
    valid: torch.Tensor  # [B, T] bool, t < n_valid[b]
    write_blocks: torch.Tensor  # [B*T] block of each token (the scratch block for padding)
    write_offsets: torch.Tensor  # [B*T] offset of each token in its block
    kv_len: int  # attend over positions [0, kv_len)
    block_size: int
    _derived: dict = field(default_factory=dict, repr=False)  # masks, int32 rows: built once

    @classmethod
    def build(
        cls,
        block_table: torch.Tensor,
        start_pos: torch.Tensor,
        n_valid: torch.Tensor,
        seq_len: int,
        kv_len: int,
        block_size: int,
        scratch: int,
    ) -> ExtendBatch:
        """block_table [B, M] int32; start_pos, n_valid [B]; scratch: the pool's scratch
        block (KVCache.scratch). No host sync: a padding token's block is looked up at a
        clamped index and replaced by the scratch block."""
        block_table = block_table.contiguous()  # the kernels step rows by stride(0)
        offsets = torch.arange(seq_len, device=start_pos.device)  # [T]
        positions = start_pos[:, None] + offsets[None, :]  # [B, T]
        valid = offsets[None, :] < n_valid[:, None]  # [B, T]
        logical = (positions // block_size).clamp(max=block_table.shape[1] - 1)
        blocks = block_table.long().gather(1, logical)  # [B, T]
        write_blocks = torch.where(valid, blocks, torch.full_like(blocks, scratch))
        return cls(
            block_table=block_table,
            positions=positions,
            valid=valid,
            write_blocks=write_blocks.flatten(),
            write_offsets=(positions % block_size).flatten(),
            kv_len=kv_len,
            block_size=block_size,
        )

    @property
    def capacity(self) -> int:
        """Positions a row's table addresses (M * block_size)."""
        return self.block_table.shape[1] * self.block_size

    def int32_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, valid) as contiguous int32 [B, T]: what the Triton attention kernel
        reads, converted once per call for all the layers (two kernels fewer per layer)."""
        if "int32" not in self._derived:
            self._derived["int32"] = (
                self.positions.to(torch.int32).contiguous(),
                self.valid.to(torch.int32).contiguous(),
            )
        return self._derived["int32"]

    def mask(self, window: int | None = None) -> torch.Tensor:
        """Boolean attention mask [B, 1, T, L]: causal, optionally a sliding window of `window`
        positions ending at the query (transformers: kv > q - window)."""
        if window not in self._derived:
            kv_pos = torch.arange(self.kv_len, device=self.positions.device)  # [L]
            q_pos = self.positions[:, :, None]  # [B, T, 1]
            allowed = kv_pos[None, None, :] <= q_pos  # [B, T, L]
            if window is not None:
                allowed = allowed & (kv_pos[None, None, :] > q_pos - window)
            # padding queries see position 0 so that no softmax row is empty (no NaN)
            allowed = allowed | (~self.valid[:, :, None] & (kv_pos == 0)[None, None, :])
            self._derived[window] = allowed[:, None]  # [B, 1, T, L]
        return self._derived[window]
