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


class HostCopy:
    """A device tensor on its way to the host: on CUDA a copy into pinned memory queued
    without waiting, so that `values` waits for the copy alone (not for work queued after
    it: start it before queueing the forward whose time the host should use). On a CPU
    device, the tensor itself."""

    def __init__(self, tensor: torch.Tensor):
        self._event: torch.cuda.Event | None = None
        if tensor.device.type == "cuda":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            tensor = host
        self._tensor = tensor

    def values(self) -> list:
        """The tensor's values as (nested) lists, once the copy has landed."""
        if self._event is not None:
            self._event.synchronize()
        return self._tensor.tolist()
