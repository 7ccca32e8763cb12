"""FP8 versions of parallel.layers' tensor-parallel linears (see runtime.models.quant).

Column-parallel: a rank holds output rows [out_start, out_stop), so its per-channel scales
are the same rows of the checkpoint's (`shards()` tells the loader). Row-parallel: a rank
holds input columns, every output channel, so the scales are read whole; each rank's partial
product is already scaled (the scale is per output channel, the same on every rank) before
the all-reduce sums them. Imported only under tensor parallelism.

On the fused FP8 path (runtime.models.quant.FUSE_FP8) a column-parallel linear hands its raw
GEMM output to the next kernel like FP8Linear; a row-parallel one rescales first (its own
kernel, as unfused), because the all-reduce must sum rescaled partial products.
"""
from __future__ import annotations

import torch

from parallel.layers import ColumnParallelLinear, RowParallelLinear, Shard
from parallel.mappings import all_reduce
from runtime.models import fused
from runtime.models.quant import FP8Act, FP8Mixin, fp8_gemm_raw, fp8_linear


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
        out = fused.fp8_rescale(fp8_gemm_raw(x.data, self.weight), x.scale,
                                self.weight_scale, None, x.dtype)
        out = all_reduce(out, self.group)
        return out if self.bias is None else out + self.bias


FP8_TP_CLASSES = {ColumnParallelLinear: FP8ColumnParallelLinear,
                  RowParallelLinear: FP8RowParallelLinear}
