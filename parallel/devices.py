"""A worker device: a CUDA GPU or a CPU process slot, and how one is written in a config.

A device may name its node (the node rank of the launch: torchrun's --node-rank, or the
place of its host among mpirun's hosts): `n1:0` is CUDA 0 of node 1, `n1:cpu:0` a CPU slot
there. A device without one (`0`, `cuda:1`, `cpu:0`) has node None: today's numbering, where
a CUDA index is global to the job (see parallel.topology and docs/multinode.md). `n0:0` and
`n1:0` are two devices; `0` and `n0:0` are too, until resolve_nodes reads every bare device
of a config that names nodes as a device of node 0.

Pure data: importing it needs no torch (`torch_device` imports torch when asked). Errors are
ValueErrors without a key; runtime.config.parse_device names the config key at fault.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["Device", "names_nodes", "resolve_nodes"]

_DEVICE_RE = re.compile(r"(?:n(\d+):)?(?:(cpu|cuda)(?::(\d+))?|(\d+))")
_DEVICE_HELP = (
    "use a CUDA index (0, 1, ...), 'cuda:N', 'cpu' or 'cpu:N', optionally after "
    "a node: 'n1:0', 'n1:cuda:0', 'n1:cpu:0'"
)


def _check_int(value: Any, what: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"device {what} must be an int >= 0, got {value!r}")


@dataclass(frozen=True)
class Device:
    """One worker device: a CUDA GPU or a CPU process slot (cpu:N are just slots), on node
    `node` of the launch (None: not named, today's global numbering)."""

    kind: str  # 'cuda' | 'cpu'
    index: int
    node: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("cuda", "cpu"):
            raise ValueError(f"device kind must be 'cuda' or 'cpu', got {self.kind!r}")
        _check_int(self.index, "index")
        if self.node is not None:
            _check_int(self.node, "node")

    def __str__(self) -> str:
        where = "" if self.node is None else f"n{self.node}:"
        return f"{where}{self.kind}:{self.index}"

    def on_node(self, node: int) -> Device:
        return dataclasses.replace(self, node=node)

    @property
    def torch_device(self) -> torch.device:
        """On the device's own host: a named node's CUDA index is local to it."""
        import torch

        return torch.device("cpu") if self.kind == "cpu" else torch.device("cuda", self.index)

    @classmethod
    def parse(cls, value: Any) -> Device:
        """0 -> cuda:0, '1' -> cuda:1, 'cuda:1', 'cpu' -> cpu:0, 'cpu:2', 'n1:0' -> CUDA 0 of
        node 1, 'n1:cuda:0', 'n1:cpu:2'; else ValueError."""
        if isinstance(value, Device):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            if value < 0:
                raise ValueError(f"invalid device {value}: CUDA indices are >= 0")
            return cls("cuda", value)
        if not isinstance(value, str):
            raise ValueError(f"invalid device {value!r} ({type(value).__name__}); {_DEVICE_HELP}")
        match = _DEVICE_RE.fullmatch(value.strip().lower())
        if match is None:
            raise ValueError(f"invalid device {value!r}; {_DEVICE_HELP}")
        node, kind, index, bare = match.groups()
        node = None if node is None else int(node)
        if bare is not None:
            return cls("cuda", int(bare), node)
        return cls(kind, int(index) if index is not None else 0, node)


def names_nodes(*lists: Sequence[Device]) -> bool:
    """Whether any device of these lists names its node."""
    return any(d.node is not None for devices in lists for d in devices)


def resolve_nodes(*lists: Sequence[Device]) -> tuple[tuple[Device, ...], ...]:
    """The lists as they are when no device names a node (today's global numbering); else
    with every bare device read as a device of node 0 (`1` is `n0:1`), so that a config mixes
    the two styles only one way."""
    if not names_nodes(*lists):
        return tuple(tuple(devices) for devices in lists)
    return tuple(
        tuple(d if d.node is not None else d.on_node(0) for d in devices) for devices in lists
    )
