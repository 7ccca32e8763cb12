"""FP8 versions of every linear class the model builds, and `to_fp8`, which swaps them in.

nn.Linear becomes quant.FP8Linear; parallel.layers' tensor-parallel linears become the classes
below (see runtime.models.arch.quant for the FP8 GEMM).

Column-parallel: a rank holds output rows [out_start, out_stop), so its per-channel scales
are the same rows of the checkpoint's (`shards()` tells the loader). Row-parallel: a rank
holds input columns, every output channel, so the scales are read whole; each rank's partial
product is already scaled (the scale is per output channel, the same on every rank) before
the all-reduce sums them.

On the fused FP8 path (runtime.models.arch.quant.FUSE_FP8) a column-parallel linear hands its raw
GEMM output to the next kernel like FP8Linear; a row-parallel one rescales first (its own
kernel, as unfused), because the all-reduce must sum rescaled partial products.
"""

from __future__ import annotations

import torch
from torch import nn

from parallel.layers import ColumnParallelLinear, RowParallelLinear, Shard
from parallel.mappings import all_reduce
from runtime.models.arch import fused
from runtime.models.arch.quant import FP8Act, FP8Linear, FP8Mixin, fp8_gemm_raw, fp8_linear


class FP8ColumnParallelLinear(FP8Mixin, ColumnParallelLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.bias)

    def shards(self) -> dict[str, Shard]:
        return {**super().shards(), "weight_scale": Shard(0, self.out_start, self.out_stop)}


class FP8RowParallelLinear(FP8Mixin, RowParallelLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce(fp8_linear(x, self.weight, self.weight_scale), self.group)
        return out if self.bias is None else out + self.bias

    def forward_fp8(self, x: FP8Act) -> torch.Tensor:
        """The partial GEMM on a quantized input [M, in shard], rescaled, all-reduced, plus
        the bias: [M, out] in x.dtype, the same operations as forward."""
        out = fused.fp8_rescale(
            fp8_gemm_raw(x.data, self.weight), x.scale, self.weight_scale, None, x.dtype
        )
        out = all_reduce(out, self.group)
        return out if self.bias is None else out + self.bias


FP8_TP_CLASSES = {
    ColumnParallelLinear: FP8ColumnParallelLinear,
    RowParallelLinear: FP8RowParallelLinear,
}


def fp8_class(cls: type) -> type:
    """The FP8 class of a float linear class (parallel.layers' TP linears included)."""
    if issubclass(cls, FP8Mixin):
        return cls
    if cls is nn.Linear:
        return FP8Linear
    if cls not in FP8_TP_CLASSES:
        raise TypeError(f"no FP8 version of {cls.__name__}")
    return FP8_TP_CLASSES[cls]


def to_fp8(linear: nn.Linear) -> None:
    """Make `linear` (on the meta device, not yet loaded) an FP8 linear in place: its class
    becomes the FP8 one (so a TP layer keeps its slice and group) and it gains a meta
    `weight_scale` [out]; the loader then fills both."""
    if isinstance(linear, FP8Mixin):
        return
    linear.__class__ = fp8_class(type(linear))
    linear.weight_scale = nn.Parameter(
        torch.empty(linear.out_features, dtype=torch.float32, device=linear.weight.device),
        requires_grad=False,
    )
