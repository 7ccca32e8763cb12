"""The static shapes the runners capture CUDA graphs at, and the capture itself.

A static step pads its batch to a batch bucket (`batch_buckets`) and, where attention does not
read lengths on the device, its attended KV length to a KV bucket (`kv_bucket`): 256, 512,
1024, 2048, then multiples of 2048. `record_graph` warms a forward up on a side stream and
records it into a memory pool shared by a model's decode and prefill graphs.
"""

from __future__ import annotations

import torch

KV_BUCKET_MIN = 256  # smallest attended KV length of a static step
KV_BUCKET_LINEAR = 2048  # KV buckets double up to here, then grow by this much


def batch_buckets(max_batch: int) -> list[int]:
    """[1, 2, 4, ...] below max_batch, then max_batch itself."""
    sizes, size = [], 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return sizes + [max_batch]


def kv_buckets(cache_len: int) -> list[int]:
    """Every attended length kv_bucket can return for this cache."""
    sizes, n = [], 1
    while True:
        size = kv_bucket(n, cache_len)
        sizes.append(size)
        if size >= cache_len:
            return sizes
        n = size + 1


def kv_bucket(kv_len: int, cache_len: int) -> int:
    """The attended length for kv_len valid positions: 256, 512, 1024, 2048, then multiples
    of 2048, never beyond the cache."""
    size = KV_BUCKET_MIN
    while size < kv_len and size < KV_BUCKET_LINEAR:
        size *= 2
    if size < kv_len:
        size = -(-kv_len // KV_BUCKET_LINEAR) * KV_BUCKET_LINEAR
    return min(size, cache_len)


def record_graph(forward, device: torch.device, pool) -> torch.cuda.CUDAGraph:
    """Run `forward` once on a side stream (warm-up: lazy compilation, allocator), then record
    it as a CUDA graph in the memory pool `pool` (shared by a model's decode and prefill
    graphs, so they cost the largest one's memory, not the sum)."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        forward()
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        forward()
    return graph
