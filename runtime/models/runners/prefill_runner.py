"""Prefill: prompts in bucketed static chunks replayed from CUDA graphs, or in long chunks.

Why: run eagerly at its own shape, a prompt's forward is CPU-bound on a GPU (per layer the
Python of the model and the guards of the torch.compile'd pieces, some 400 launches for an
8b model), so the time to first token was mostly host time. Here a call of T tokens per row
is split into chunks of at most `chunk_for(batch)` tokens (a chunk bucket: 16, 32, 64, 128,
256); each chunk is padded to the smallest bucket holding it and runs through
`model.forward_static` at a static shape, attending the KV that the earlier chunks wrote
plus itself causally (each token's absolute position says what it may see). On CUDA each
(batch bucket, chunk bucket, attended length) is captured once as a CUDA graph (at startup,
runtime.models.runners.step_runner.StepRunner.capture_all, else on first use) and replayed: one
launch per chunk. On CPU the same chunks run eagerly, so CPU tests cover the chunking.

Attention: with the Triton kernels on, every chunk attends straight over the paged cache
(the slot kernel for chunks of at most SLOT_KERNEL_ROWS stacked query rows, the
flash-attention prefill kernel for longer ones: runtime.models.arch.attention._attend), and
both read each row's length on the device, so one graph serves every KV length (the attended
length passed is the whole cache). Without them (CPU) chunks take grouped_attention over
KVCache.read with a mask: their attended length is rounded up to a KV bucket
(graphs.kv_bucket), one graph per bucket.

Long prompts: a call without full logits (a shard's prefill, a prompt's first token) whose
longest row has LONG_MIN_TOKENS or more goes in long chunks instead (`_run_long`): LONG_TOKENS
tokens a call, eagerly at their own width (matrix products of thousands of rows are
compute-bound, so the launches' host time hides behind them), through the model's hidden
states only, with the LM head at each row's last token where its logits are wanted.

Memory: a graph's tokens (batch bucket x chunk bucket) stay within `max_tokens` (the
activations and the lm_head's logits of one chunk are what its graph holds while it runs),
its logits are copied into one static [max_tokens, V] buffer, and the graphs share the step
runner's memory pool, so they cost about one chunk's activations, not one per graph.
"""

from __future__ import annotations

import torch

from runtime.models import kernels
from runtime.models.arch import attention
from runtime.models.arch.base import CausalLM, PagedModel, is_paged
from runtime.models.runners.graphs import kv_bucket, kv_buckets, record_graph
from runtime.models.runners.hostcopy import copy_into, to_device
from runtime.models.runners.tables import StaticTable

CHUNK_BUCKETS = (16, 32, 64, 128, 256)  # tokens per row of a prefill chunk
MAX_TOKENS = 512  # batch bucket x chunk bucket of one prefill graph, at most
MAX_STARTUP_GRAPHS = 64  # prefill graphs captured at startup at most; more on first use
LONG_TOKENS = 2048  # rows x tokens of one eager chunk of a long prompt (_run_long)
# the fewest tokens of a row that go in long chunks: below, the graph chunks replay without
# host time. Measured on an H200 (h200_bench.sh trt-70b): a 500-token prompt of the 70b FP8
# target eagerly in one chunk took 110 ms to its first token, its 80 layers' launches
# outrunning the GPU; 2,048 tokens of the 8b target took 47.6 ms, 84 in graph chunks.
LONG_MIN_TOKENS = 1024


def attention_shape(model: PagedModel) -> tuple[int | None, int]:
    """(query rows per token that attention stacks per KV head (local heads, TP included),
    head_dim); (None, 0) for a model without runtime.models.arch.attention.Attention layers."""
    for module in model.modules():
        if isinstance(module, attention.Attention):
            return module.n_heads // module.n_kv_heads, module.head_dim
    return None, 0


def chunk_rows(starts: list[int], n_valid: list[int], step: int, stop: int):
    """The chunks of a call, `step` tokens a row, columns 0 to `stop`: (c0, begin, n) with
    the chunk's first column, each row's start position in it and its valid tokens in it
    (0 for a row already done)."""
    for c0 in range(0, stop, step):
        yield (
            c0,
            [s + min(c0, v) for s, v in zip(starts, n_valid)],
            [min(max(v - c0, 0), step) for v in n_valid],
        )


def long_chunk_bytes(model: CausalLM, tokens: int = LONG_TOKENS) -> int:
    """An upper bound of the activations one long chunk (_run_long) holds at once in a
    layer, from the model's full (not TP-sharded) shapes: gate/up and q/k/v as float32 (the
    FP8 GEMMs' raw outputs), the MLP's product and a few copies of the residual stream in
    the activation dtype; twice that for the allocator. 0 for a model that is not a
    PagedModel (it runs no long chunks)."""
    if not is_paged(model):
        return 0
    args = model.args
    qkv = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
    per_token = 4 * (2 * args.intermediate_size + qkv) + 2 * (
        args.intermediate_size + 6 * args.hidden_size
    )
    return 2 * tokens * per_token


class PrefillRunner:
    """Chunked static-shape forwards of calls longer than a decode step (prompts).

    `run` has StepRunner.run's contract: ids [B, T] on the device, the rows' block tables
    (runner.tables), per-row start and valid length on the host -> logits [B, T, V] (valid
    positions meaningful). With
    `logits=False` it only writes the KV cache (a shard's prefill needs nothing else)."""

    def __init__(
        self,
        model: PagedModel,
        device: torch.device,
        batch_sizes: list[int],
        capture: bool,
        pool=None,
        max_tokens: int = MAX_TOKENS,
        chunks: tuple[int, ...] = CHUNK_BUCKETS,
        long_tokens: int = LONG_TOKENS,
        long_min: int = LONG_MIN_TOKENS,
    ):
        self.model, self.device = model, device
        self.batch_sizes, self.chunks = batch_sizes, sorted(chunks)
        self.capture, self.pool = capture, pool
        self.long_tokens, self.long_min = long_tokens, long_min
        max_batch = batch_sizes[-1]
        self.max_tokens = max(max_tokens, max_batch * self.chunks[0])  # rows of `out`
        self.rows_per_token, self.head_dim = attention_shape(model)
        self.ids = torch.zeros(self.max_tokens, dtype=torch.long, device=device)  # [B*C]
        self.meta = torch.zeros(2, max_batch, dtype=torch.long, device=device)  # start/n
        self.table = StaticTable(model, max_batch, device)
        self.out: torch.Tensor | None = None  # [max_tokens, V] logits of the last chunk
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}

    # -- shapes ------------------------------------------------------------------------------
    def chunk_for(self, bsz: int) -> int:
        """The longest chunk for a batch bucket: bsz x chunk within max_tokens."""
        fits = [c for c in self.chunks if bsz * c <= self.max_tokens]
        return fits[-1] if fits else self.chunks[0]

    def kernel_serves(self, chunk: int) -> bool:
        """Whether attention takes a Triton kernel (no KV bucket) for chunks this long: the
        slot kernel for few stacked rows, the prefill kernel for more (attention._attend)."""
        if not kernels.enabled() or self.rows_per_token is None:
            return False
        return (
            self.rows_per_token * chunk <= attention.SLOT_KERNEL_ROWS
            or self.head_dim <= attention.PREFILL_KERNEL_MAX_DIM
        )

    def attended(self, chunk: int, kv_len: int) -> int:
        """The attended length of a chunk's graph: the whole cache when the kernel reads
        lengths on the device, else kv_len rounded up to a KV bucket."""
        cache_len = self.cache_len()
        return cache_len if self.kernel_serves(chunk) else kv_bucket(kv_len, cache_len)

    def cache_len(self) -> int:
        """The model's max_seq_len (allocate_cache came first)."""
        cache_len = self.model.max_seq_len
        assert cache_len is not None, "allocate_cache() must come first"
        return cache_len

    def startup_keys(self, limit: int = MAX_STARTUP_GRAPHS) -> list[tuple[int, int, int]]:
        """(batch bucket, chunk bucket, attended length) of every graph a prefill can need,
        those that serve every KV length first, then shortest KV first; at most `limit`."""
        cache_len = self.cache_len()
        keys = []
        for bsz in self.batch_sizes:
            allowed = [c for c in self.chunks if c <= self.chunk_for(bsz)]
            for low, chunk in zip([0] + allowed, allowed):  # chunk holds low+1..chunk tokens
                if self.kernel_serves(chunk):
                    keys.append((bsz, chunk, cache_len))
                    continue
                least = self.attended(chunk, low + 1)
                keys += [(bsz, chunk, kv) for kv in kv_buckets(cache_len) if kv >= least]
        keys.sort(key=lambda k: (0 if self.kernel_serves(k[1]) else k[2], k[0], k[1]))
        return keys[:limit]

    # -- running -----------------------------------------------------------------------------
    @torch.no_grad()
    def run(
        self,
        ids: torch.Tensor,
        rows,
        starts: list[int],
        n_valid: list[int],
        logits: bool | str = True,
    ) -> torch.Tensor | None:
        """ids [B, T] -> logits [B, T, V] (a view the next call overwrites when one chunk
        did it all), or None with logits=False, or with logits="last" each row's logits at
        its last valid token [B, V] (a prompt's first output token). B must not exceed the
        largest batch bucket. Every chunk keeps all B rows; a row already done has no valid
        token in it."""
        if logits is not True and self.goes_long(ids.shape[0], n_valid):
            return self._run_long(ids, rows, starts, n_valid, logits == "last")
        if logits == "last":
            return self._run_last(ids, rows, starts, n_valid)
        self.table.load(rows)  # every chunk of the call reads these tables
        bsz, seq = ids.shape
        padded = next(b for b in self.batch_sizes if b >= bsz)
        step = self.chunk_for(padded)
        longest = max(max(n_valid), 1)
        result = None
        for c0, begin, n in chunk_rows(starts, n_valid, step, longest):
            out = self._chunk(ids, c0, padded, begin, n)  # [B, C, V]
            if not logits:
                continue
            if c0 == 0 and step >= longest and seq <= out.shape[1]:  # one chunk did it all
                return out[:, :seq]  # the static buffer's view, as decode steps
            if result is None:
                result = torch.empty(bsz, seq, out.shape[-1], dtype=out.dtype, device=self.device)
            width = min(out.shape[1], seq - c0)
            result[:, c0 : c0 + width].copy_(out[:, :width])
        return result

    def goes_long(self, bsz: int, n_valid: list[int]) -> bool:
        """Whether a call without full logits goes in long chunks (_run_long): some row has
        at least long_min tokens (enough work a launch for the eager host time to hide:
        LONG_MIN_TOKENS) and more than one graph chunk of its batch bucket holds."""
        padded = next((b for b in self.batch_sizes if b >= bsz), bsz)
        longest = max(n_valid)
        return longest >= self.long_min and longest > self.chunk_for(padded)

    def long_chunk(self, bsz: int) -> int:
        """Tokens per row of one long chunk: long_tokens (LONG_TOKENS) in all."""
        return max(1, self.long_tokens // bsz)

    def _run_long(
        self, ids: torch.Tensor, rows, starts: list[int], n_valid: list[int], last: bool
    ) -> torch.Tensor | None:
        """A long prompt in eager chunks of long_chunk(B) tokens a row at their own width:
        the model's hidden states only (hidden_static), then the LM head at each row's
        last valid token when `last` ([B, V], as _run_last), else nothing (None)."""
        self.table.load(rows)
        bsz = ids.shape[0]
        step, table = self.long_chunk(bsz), self.table.rows(bsz)
        out = None
        for c0, begin, n in chunk_rows(starts, n_valid, step, max(n_valid)):
            kv_len = max(b + k for b, k in zip(begin, n) if k)
            hidden = self.model.hidden_static(
                ids[:, c0 : c0 + max(n)],
                table,
                to_device(begin, torch.long, self.device),
                to_device(n, torch.long, self.device),
                kv_len,
            )  # [B, C, hidden]
            ends = [b for b, v in enumerate(n_valid) if c0 < v <= c0 + step]
            if not (last and ends):
                continue
            at = to_device([n_valid[b] - 1 - c0 for b in ends], torch.long, self.device)
            logits = self.model.logits(hidden[to_device(ends, torch.long, self.device), at])
            if out is None:
                out = torch.empty(bsz, logits.shape[-1], dtype=logits.dtype, device=self.device)
            out[ends] = logits  # [E, V]
        return out

    def _run_last(
        self, ids: torch.Tensor, rows, starts: list[int], n_valid: list[int]
    ) -> torch.Tensor:
        """run(logits="last"): [B, V], row b's logits at token n_valid[b] - 1 (>= 1 each),
        copied out of the chunk that holds it."""
        self.table.load(rows)
        bsz = ids.shape[0]
        padded = next(b for b in self.batch_sizes if b >= bsz)
        step = self.chunk_for(padded)
        last = None
        for c0, begin, n in chunk_rows(starts, n_valid, step, max(n_valid)):
            out = self._chunk(ids, c0, padded, begin, n)  # [B, C, V]
            if last is None:
                last = torch.empty(bsz, out.shape[-1], dtype=out.dtype, device=self.device)
            for b, v in enumerate(n_valid):
                if c0 < v <= c0 + step:
                    last[b].copy_(out[b, v - 1 - c0])
        assert last is not None  # n_valid >= 1: one chunk at least
        return last

    def _chunk(
        self, ids: torch.Tensor, c0: int, padded: int, starts: list[int], n_valid: list[int]
    ) -> torch.Tensor:
        """The chunk of ids [B, T] from column c0, n_valid tokens per row at `starts` ->
        logits [B, C, V] (C its bucket), a view of `out`. Padding rows have no valid token:
        they write only the scratch block."""
        bsz, seq = ids.shape
        chunk = next(c for c in self.chunks if c >= max(max(n_valid), 1))
        kv_len = max([s + n for s, n in zip(starts, n_valid) if n] or [1])
        key = (padded, chunk, self.attended(chunk, kv_len))
        if self.capture and key not in self.graphs:
            self.capture_key(key)
        width = min(chunk, seq - c0)
        pad = [0] * (padded - bsz)
        self.ids[: padded * chunk].view(padded, chunk)[:bsz, :width].copy_(ids[:, c0 : c0 + width])
        copy_into(self.meta[:, :padded], [starts + pad, n_valid + pad])
        if self.capture:
            self.graphs[key].replay()
        else:
            self._forward(*key)
        assert self.out is not None  # _forward's (the graph's warm-up ran it too)
        return self.out[: padded * chunk].view(padded, chunk, -1)[:bsz]

    def _forward(self, bsz: int, chunk: int, kv_len: int) -> None:
        starts, n_valid = self.meta[:, :bsz]
        ids = self.ids[: bsz * chunk].view(bsz, chunk)  # [b, C]
        logits = self.model.forward_static(
            ids, self.table.rows(bsz), starts, n_valid, kv_len
        )  # [b, C, V]
        if self.out is None:  # first call is never inside a capture (warm-up comes first)
            self.out = torch.empty(
                self.max_tokens, logits.shape[-1], dtype=logits.dtype, device=self.device
            )
        self.out[: bsz * chunk].view(bsz, chunk, -1).copy_(logits)

    def capture_key(self, key: tuple[int, int, int]) -> None:
        """Warm up on a side stream, then record one chunk. Every row is padding while this
        runs (n_valid 0), so warm-up writes nothing but the pool's scratch block."""
        self.meta[:, : key[0]].zero_()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        self.graphs[key] = record_graph(lambda: self._forward(*key), self.device, self.pool)
