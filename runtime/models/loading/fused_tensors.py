"""Checkpoints that store fused projections (Phi-3: `self_attn.qkv_proj`, `mlp.gate_up_proj`)
read as our separate q/k/v_proj and gate/up_proj, so TP sharding and FP8 quantize-on-load
see the same names as for every other family (the model fuses them again after loading:
quant.stack_rows).

`split_fused(source, args)` wraps a WeightSource when its names hold fused tensors: each
part is a row range of the fused tensor ([q; k; v], [gate; up]), read with the inner
source's get_shard, so a TP rank still reads only its slice from the file. Stored FP8 scales
split the same way (a per-tensor scale is shared by the parts).
"""

from __future__ import annotations

import torch

from runtime.models.arch.model_args import ModelArgs
from runtime.models.loading.weights import WeightSource, read_shard

# fused checkpoint module -> our modules, in the order of their rows
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
SPLIT_ATTRS = ("weight", "bias", "weight_scale")


def _part_rows(args: ModelArgs, fused: str) -> tuple[int, ...]:
    if fused == "self_attn.qkv_proj":
        q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        return q, kv, kv
    return args.intermediate_size, args.intermediate_size


def split_fused(source: WeightSource, args: ModelArgs) -> WeightSource:
    """`source` itself when it stores no fused projection, else a SplitFused over it."""
    names = source.names()
    if not any(n.rpartition(".")[0].endswith(tuple(FUSED)) for n in names):
        return source
    return SplitFused(source, args)


class SplitFused:
    """A WeightSource: fused tensors listed as their parts (see the module docstring)."""

    def __init__(self, inner: WeightSource, args: ModelArgs):
        self.inner = inner
        self._parts: dict[str, tuple[str, int, int]] = {}  # part -> (fused name, start, rows)
        for name in inner.names():
            module, _, attr = name.rpartition(".")
            match = next((f for f in FUSED if module.endswith("." + f)), None)
            if match is None or attr not in SPLIT_ATTRS:
                continue
            base = module[: -len(match)]
            start = 0
            for part, rows in zip(FUSED[match], _part_rows(args, match)):
                self._parts[f"{base}{part}.{attr}"] = (name, start, rows)
                start += rows

    def names(self) -> set[str]:
        fused = {name for name, _, _ in self._parts.values()}
        return (self.inner.names() - fused) | set(self._parts)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._parts:
            return self.inner.get(name)
        fused, start, rows = self._parts[name]
        if name.endswith(".weight_scale"):
            scale = self.inner.get(fused)
            if scale.numel() == 1:  # per tensor: shared by the parts
                return scale
            return scale.reshape(-1)[start : start + rows].clone()
        return self.inner.get_shard(fused, 0, start, start + rows)

    def get_shard(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        if name not in self._parts:
            return self.inner.get_shard(name, dim, start, stop)
        fused, offset, rows = self._parts[name]
        if dim == 0 and not name.endswith(".weight_scale") and stop <= rows:
            return self.inner.get_shard(fused, 0, offset + start, offset + stop)
        full = self.get(name)
        return read_shard(full.__getitem__, full.shape, dim, start, stop).clone()

    def close(self) -> None:
        self._parts.clear()
        self.inner.close()
