"""Host -> device copies that never wait for the device.

`torch.tensor(values, device="cuda")` copies from pageable memory and synchronises the stream,
so every small index tensor built that way stalls the host until the GPU has caught up. Here
the values go through pinned memory (torch's caching host allocator keeps a block alive until
its copy has run) and the copy is queued without waiting.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `values` on `device`, queued without a host synchronisation on CUDA."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def copy_into(dst: torch.Tensor, values: Sequence) -> None:
    """dst.copy_(values) with the same guarantee; dst keeps its storage (CUDA graph inputs)."""
    host = torch.tensor(values, dtype=dst.dtype)
    if dst.device.type == "cuda":
        host = host.pin_memory()
    dst.copy_(host, non_blocking=True)
