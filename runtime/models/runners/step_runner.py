"""Decode and verify steps at static shapes, replayed from CUDA graphs.

A step appends at most `max_step_len` tokens per row (the draft's decode steps, the target's
k + 1 verify positions). The caller knows every length on the host, so a StepRunner never
reads the device: it pads the batch to a bucket size (padding rows have n_valid 0 and write
only the KV pool's scratch block), rounds the attended KV length up to a bucket, copies the
inputs (ids, starts, lengths and the rows' block tables: runner.tables) into static buffers
and runs `model.forward_static` on them (a PagedModel: runtime.models.arch.base). On CUDA each
(batch bucket, step length, KV bucket) is captured once as a CUDA graph on first use and
replayed from then on: one launch per step instead of one per kernel; the elementwise
pieces of each layer are torch.compile'd first (runtime/models/arch/fused.py). On CPU the same
static path runs eagerly, so CPU tests cover the padding and bucketing the graphs use.
With the Triton attention kernel (runtime/models/kernels, on by default on CUDA) attention
reads each row's length on the device, so no KV bucket is needed: one graph per (batch
bucket, step length) serves every KV length.

Longer calls (prompts) go to runtime.models.runners.prefill_runner.PrefillRunner: bucketed chunks at
static shapes, CUDA graphs of their own captured with these (same memory pool), unless
prefill graphs are off (`prefill_graphs=False`): then they, like
every call of a model that is not a PagedModel, run eagerly at their own shape.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from runtime.models import kernels
from runtime.models.arch import fused
from runtime.models.arch.base import CausalLM, PagedModel, is_paged
from runtime.models.runners.graphs import batch_buckets, kv_bucket, kv_buckets, record_graph
from runtime.models.runners.hostcopy import copy_into, to_device
from runtime.models.runners.prefill_runner import PrefillRunner
from runtime.models.runners.tables import StaticTable, device_table

MAX_STARTUP_GRAPHS = 512  # captured at startup at most; further shapes on first use


class StepRunner:
    def __init__(
        self,
        model: CausalLM,
        device: torch.device,
        max_batch: int,
        max_step_len: int,
        cuda_graphs: bool = True,
        prefill_graphs: bool | None = None,
    ):
        """prefill_graphs: calls longer than max_step_len in static chunks (PrefillRunner;
        True or None, the default), else (False) eagerly at their shape."""
        self.model, self.device = model, device
        self.max_batch, self.max_step_len = max_batch, max_step_len
        self.static = is_paged(model)  # static-shape steps (else forward_extend as it is)
        self.capture = cuda_graphs and self.static and device.type == "cuda"
        # one attended length serves every step when attention reads each row's length on
        # the device (the Triton kernel); else KV lengths are rounded up to buckets
        self.kv_static = False
        if self.capture:  # fused elementwise kernels; graphs then replay them
            fused.compile_kernels(device)
            self.kv_static = kernels.enable(device)
        self.buckets = batch_buckets(max_batch)
        self.ids = torch.zeros(max_batch, max_step_len, dtype=torch.long, device=device)
        self.meta = torch.zeros(2, max_batch, dtype=torch.long, device=device)  # start/n
        self.table = StaticTable(model, max_batch, device) if is_paged(model) else None
        self.out: torch.Tensor | None = None  # [max_batch, max_step_len, V] logits
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        # one memory pool shared by all graphs, the prefill graphs' included
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.chunked = (
            PrefillRunner(model, device, self.buckets, self.capture, self.pool)
            if is_paged(model) and prefill_graphs is not False
            else None
        )

    @torch.no_grad()
    def capture_all(
        self,
        step_lens: list[int],
        limit: int = MAX_STARTUP_GRAPHS,
        progress: Callable[[int, int], None] | None = None,
    ) -> int:
        """Capture the graphs steps of these lengths can need (each batch bucket and KV
        bucket), shortest KV first, at most `limit` of them, then the
        prompt chunks' graphs (PrefillRunner.startup_keys): requests then pay for no capture
        (longer contexts of very long max_seq_len configs capture on first use). Returns
        how many graphs there are. `progress(done, total)` hears of each capture (the first
        also compiles the fused kernels); nothing without CUDA."""
        if not self.capture:
            return 0
        keys = [
            (bsz, seq, kv_len)
            for kv_len in self._kv_buckets()
            for bsz in self.buckets
            for seq in step_lens
        ]
        todo = [(self._capture, key) for key in keys[:limit] if key not in self.graphs]
        chunked = self.chunked if self.chunked is not None and self.chunked.capture else None
        if chunked is not None:  # then the prompts' chunks (PrefillRunner.startup_keys)
            todo += [
                (chunked.capture_key, key)
                for key in chunked.startup_keys()
                if key not in chunked.graphs
            ]
        if progress is not None:
            progress(0, len(todo))
        for done, (capture, key) in enumerate(todo, 1):
            capture(key)
            if progress is not None:
                progress(done, len(todo))
        return self.graph_count()

    def graph_count(self) -> int:
        """Graphs captured: decode/verify steps plus prompt chunks."""
        return len(self.graphs) + (len(self.chunked.graphs) if self.chunked else 0)

    def prefill(self, ids: torch.Tensor, rows, starts: list[int], n_valid: list[int]) -> None:
        """run() for callers that need only the KV cache written (a shard's prompts): no
        logits are assembled across the chunks."""
        chunked = self._chunked(ids)
        if chunked is not None:
            chunked.run(ids, rows, starts, n_valid, logits=False)
        else:
            self.run(ids, rows, starts, n_valid)

    def prefill_last(
        self, ids: torch.Tensor, rows, starts: list[int], n_valid: list[int]
    ) -> torch.Tensor:
        """run() for a prompt's first output token: each row's logits at its last valid
        token [B, V] (n_valid >= 1 each), nothing else assembled across the chunks."""
        chunked = self._chunked(ids)
        if chunked is not None:
            return _logits(chunked.run(ids, rows, starts, n_valid, logits="last"))
        logits = self.run(ids, rows, starts, n_valid)  # [B, T, V]
        last = to_device([n - 1 for n in n_valid], torch.long, self.device)
        return logits[torch.arange(len(n_valid), device=self.device), last]

    def _chunked(self, ids: torch.Tensor) -> PrefillRunner | None:
        """The prefill runner where this call goes to it (static, longer than a step)."""
        if self.static and ids.shape[0] <= self.max_batch and ids.shape[1] > self.max_step_len:
            return self.chunked
        return None

    def _paged(self) -> PagedModel:
        """The model, as the PagedModel that static steps run (self.static)."""
        assert is_paged(self.model)
        return self.model

    def _cache_len(self) -> int:
        """The model's max_seq_len (allocate_cache came first)."""
        cache_len = self._paged().max_seq_len
        assert cache_len is not None, "allocate_cache() must come first"
        return cache_len

    @torch.no_grad()
    def run(self, ids: torch.Tensor, rows, starts: list[int], n_valid: list[int]) -> torch.Tensor:
        """ids [B, T] on the device; rows: the rows' block tables [B, M] (an int32 device
        tensor, or lists; slots [B] stand for their fixed tables: tables.device_table; a
        model that is not a PagedModel gets rows as they are: slots); per-row start position
        and valid length on the host -> logits [B, T, V]. Static steps return a view that
        the next call overwrites."""
        chunked = self._chunked(ids)
        if chunked is not None:
            return _logits(chunked.run(ids, rows, starts, n_valid))
        bsz, seq = ids.shape
        kv_len = max(s + n for s, n in zip(starts, n_valid))
        if not self.static or bsz > self.max_batch or seq > self.max_step_len:  # eager
            start_t, n_t = (to_device(v, torch.long, self.device) for v in (starts, n_valid))
            if not self.static:
                return self.model.forward_extend(ids, rows, start_t, n_t)
            model = self._paged()
            table = device_table(rows, model.blocks_per_seq, self.device)
            return model.forward_static(ids, table, start_t, n_t, kv_len)
        padded = next(b for b in self.buckets if b >= bsz)
        key = (padded, seq, self._kv_bucket(kv_len))
        if self.capture and key not in self.graphs:
            self._capture(key)
        pad = [0] * (padded - bsz)
        self.ids[:bsz, :seq].copy_(ids)
        assert self.table is not None  # a PagedModel's
        self.table.load(rows)
        copy_into(self.meta[:, :padded], [starts + pad, n_valid + pad])
        if self.capture:
            self.graphs[key].replay()
        else:
            self._forward(*key)
        return _logits(self.out)[:bsz, :seq]

    def _kv_buckets(self) -> list[int]:
        cache_len = self._cache_len()
        return [cache_len] if self.kv_static else kv_buckets(cache_len)

    def _kv_bucket(self, kv_len: int) -> int:
        cache_len = self._cache_len()
        return cache_len if self.kv_static else kv_bucket(kv_len, cache_len)

    def _forward(self, bsz: int, seq: int, kv_len: int) -> None:
        starts, n_valid = self.meta[:, :bsz]
        assert self.table is not None  # a PagedModel's
        logits = self._paged().forward_static(
            self.ids[:bsz, :seq], self.table.rows(bsz), starts, n_valid, kv_len
        )  # [b, T, V]
        if self.out is None:  # first call is never inside a capture (warm-up comes first)
            self.out = torch.empty(
                self.max_batch,
                self.max_step_len,
                logits.shape[-1],
                dtype=logits.dtype,
                device=self.device,
            )
        self.out[:bsz, :seq].copy_(logits)

    def _capture(self, key: tuple[int, int, int]) -> None:
        """Warm up on a side stream, then record one step. Every row is padding while this
        runs (n_valid 0), so warm-up writes nothing but the pool's scratch block."""
        self.meta[:, : key[0]].zero_()
        self.graphs[key] = record_graph(lambda: self._forward(*key), self.device, self.pool)


def _logits(out: torch.Tensor | None) -> torch.Tensor:
    """Logits a step or prefill call was asked for (never None then)."""
    assert out is not None
    return out
