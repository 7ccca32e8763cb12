"""A worker device: a CUDA GPU or a CPU process slot, and how one is written in a config.

Pure data: importing it needs no torch (`torch_device` imports torch when asked). Errors are
ValueErrors without a key; runtime.config.parse_device names the config key at fault.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["Device"]

_DEVICE_RE = re.compile(r"(?:(cpu|cuda)(?::(\d+))?|(\d+))")
_DEVICE_HELP = "use a CUDA index (0, 1, ...), 'cuda:N', 'cpu' or 'cpu:N'"


@dataclass(frozen=True)
class Device:
    """One worker device: a CUDA GPU or a CPU process slot (cpu:N are just slots)."""

    kind: str    # 'cuda' | 'cpu'
    index: int

    def __post_init__(self) -> None:
        if self.kind not in ("cuda", "cpu"):
            raise ValueError(f"device kind must be 'cuda' or 'cpu', got {self.kind!r}")
        if not isinstance(self.index, int) or isinstance(self.index, bool) or self.index < 0:
            raise ValueError(f"device index must be an int >= 0, got {self.index!r}")

    def __str__(self) -> str:
        return f"{self.kind}:{self.index}"

    @property
    def torch_device(self) -> "torch.device":
        import torch

        return torch.device("cpu") if self.kind == "cpu" else torch.device("cuda", self.index)

    @classmethod
    def parse(cls, value: Any) -> "Device":
        """0 -> cuda:0, '1' -> cuda:1, 'cuda:1', 'cpu' -> cpu:0, 'cpu:2'; else ValueError."""
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
        kind, index, bare = match.groups()
        if bare is not None:
            return cls("cuda", int(bare))
        return cls(kind, int(index) if index is not None else 0)
