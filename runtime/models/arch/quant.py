"""FP8 (e4m3) weights: the linear layers that hold them and the GEMM that reads them.

An FP8 linear keeps `weight` [out, in] in torch.float8_e4m3fn and `weight_scale` [out] in
float32, one scale per output channel: the real weight is weight * weight_scale[:, None].
Checkpoints with one scale per tensor are expanded to per channel on load (the same value for
every row), so fused q/k/v and gate/up stacks with different per-tensor scales stay exact and
tensor-parallel shards cut the scale rows with the weight rows.

The GEMM (`fp8_linear`) has two paths:

- weight-only (CPU, float32 activations anywhere, GPUs without FP8 tensor cores): the weight
  is dequantized in the GEMM's input (fused.fp8_dequantize: one cast and one multiply, in
  float32), then an ordinary F.linear. With float32 activations this is exactly a float32
  model holding the dequantized weights, which is what the CPU tests compare against.
- FP8 GEMM (CUDA, compute capability >= 8.9, bf16/fp16 activations): the activation rows are
  quantized dynamically per token (fused.fp8_quantize_rows: amax / 448 per row), then
  torch._scaled_mm runs with per-tensor scales of 1.0, and both scales are applied to its
  output in one elementwise kernel (fused.fp8_rescale: out[m, n] * x_scale[m] * w_scale[n]
  + bias). A per-token activation scale is a row scale of the GEMM's output and a per-channel
  weight scale a column scale, so this is exact in the scales; unscaled _scaled_mm runs the
  decode shapes (M = 1..16) in about 0.52x the bf16 GEMM's time on an H200, against 0.8x with
  row-wise scale tensors. Dynamic per-token scales are used even where a checkpoint carries
  static input scales: they never clip, cost the same kernel, and need no calibration.

Fused neighbours (FUSE_FP8): on the FP8 GEMM path a decoder layer does not run the quantize
and rescale kernels of its own. Its norms quantize their output (`FP8Act`), the linears'
`forward_fp8` run only the GEMM and hand back its raw float32 output with the scales still to
apply (`FP8Out`), and the next elementwise kernel applies them (fused.add_rms_norm_fp8,
silu_mul_fp8, rotary_write_fp8): the same sequence of operations, in fewer kernels. A row-
parallel (TP) linear rescales before its all-reduce, which must sum rescaled outputs.

fp8_linears.to_fp8 turns an nn.Linear (or one of parallel.layers' TP linears) built on the meta
device
into its FP8 class before loading; `stack_rows` fuses q/k/v and gate/up into one GEMM.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from runtime.models.arch import fused

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# the linears of a decoder layer that run in FP8; embeddings, norms and the LM head stay float
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_GEMM = True  # False: the weight-only path everywhere (examples/gpu/fp8_check.py compares)
GEMM_ALIGN = 16  # torch._scaled_mm needs K and N to be multiples of 16
# False: the FP8 GEMM path with its own quantize / rescale kernels (the reference tests and
# examples/gpu/fp8_check.py compare the fused path with)
FUSE_FP8 = True
# tests: the FP8 GEMM path on any device and dtype, _scaled_mm (CUDA-only) emulated in float32
EMULATE_FP8_GEMM = False


class FP8Act(NamedTuple):
    """An activation quantized per token for an FP8 GEMM (fused.fp8_quantize_rows' output)."""

    data: torch.Tensor  # [M, K] e4m3
    scale: torch.Tensor  # [M, 1] float32
    dtype: torch.dtype  # the float activation's dtype: that of the GEMM's rescaled output


class FP8Out(NamedTuple):
    """An unscaled FP8 GEMM's output, its scales (and bias) not yet applied: the consumer's
    fused kernel applies them as fused.fp8_rescale does (out * x_scale * w_scale + bias)."""

    raw: torch.Tensor  # [M, N] float32
    x_scale: torch.Tensor  # [M, 1] the activation's per-token scales
    w_scale: torch.Tensor  # [N] the weight's per-channel scales
    bias: torch.Tensor | None  # [N]


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> ([out, in] e4m3, [out] float32 scale): scale = amax / 448 of each
    output row (1.0 for an all-zero row), values weight / scale cast round-to-nearest."""
    w = weight.float()
    amax = w.abs().amax(dim=1)  # [out]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(
    weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[out, in] e4m3 and [out] scale -> the weight the FP8 layer computes with, in dtype
    (float32: bit for bit what the weight-only GEMM uses)."""
    return fused.fp8_dequantize(weight, scale, dtype)


@functools.cache
def _fp8_tensor_cores(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


@functools.cache
def _one(device: torch.device) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32, device=device)


def uses_fp8_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether fp8_linear(x, weight, ...) runs an FP8 GEMM (else weight-only). Host-side
    facts only (no device read), so the choice is the same in eager and CUDA-graph steps."""
    if not (FP8_GEMM and weight.shape[0] % GEMM_ALIGN == 0 and weight.shape[1] % GEMM_ALIGN == 0):
        return False
    if EMULATE_FP8_GEMM:
        return True
    return (
        x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and _fp8_tensor_cores(
            x.device.index if x.device.index is not None else torch.cuda.current_device()
        )
    )


def fp8_gemm_raw(x8: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x8 [M, K] e4m3 @ weight [N, K] e4m3 ^T, unscaled -> [M, N] float32: torch._scaled_mm
    with unit scales; off CUDA under EMULATE_FP8_GEMM, the float32 product of the same values
    (exact products, float32 sums: what tests can run on CPU)."""
    if EMULATE_FP8_GEMM and not x8.is_cuda:
        return x8.float() @ weight.float().t()
    one = _one(x8.device)
    return torch._scaled_mm(x8, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., in] @ (weight [out, in] e4m3 * scale [out])^T + bias -> [..., out] in x.dtype.
    See the module docstring for the two paths."""
    if not uses_fp8_gemm(x, weight):
        return F.linear(x, fused.fp8_dequantize(weight, scale, x.dtype), bias)
    rows = x.reshape(-1, x.shape[-1])  # [M, in]
    x8, x_scale = fused.fp8_quantize_rows(rows)  # [M, in], [M, 1]
    out = fp8_gemm_raw(x8, weight)  # [M, out] float32
    out = fused.fp8_rescale(out, x_scale, scale, bias, x.dtype)
    return out.view(*x.shape[:-1], out.shape[-1])


def fuses_fp8(x: torch.Tensor, *linears) -> bool:
    """Whether a layer runs these linears (FP8 linears or RowStacks; None: unfused) with their
    quantize / rescale steps folded into its elementwise kernels: FUSE_FP8, all FP8, and all
    on the FP8 GEMM path for activations like x. Host-side facts only (see uses_fp8_gemm)."""
    return FUSE_FP8 and all(
        lin is not None
        and (lin.fp8 if isinstance(lin, RowStack) else is_fp8(lin))
        and uses_fp8_gemm(x, lin.weight)
        for lin in linears
    )


class FP8Mixin(nn.Linear):
    """What every FP8 linear adds to its float linear class (nn.Linear or one of its TP
    subclasses, the mixin's next base): the per-channel `weight_scale` and the dtypes the
    loader must keep (runtime.models.loading.loader casts everything else to `dtype`)."""

    LOAD_DTYPES = {"weight": FP8, "weight_scale": torch.float32}
    weight_scale: nn.Parameter

    def forward_fp8(self, x: FP8Act) -> FP8Out | torch.Tensor:
        """The GEMM alone on an already quantized input [M, in]: its raw output [M, out] for
        the consumer's kernel to rescale (a row-parallel linear overrides this)."""
        return FP8Out(fp8_gemm_raw(x.data, self.weight), x.scale, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8_e4m3 per-channel scales"


class FP8Linear(FP8Mixin, nn.Linear):
    """nn.Linear with an e4m3 weight and per-output-channel scales."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.bias)


def load_dtype(model: nn.Module, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype parameter `name` is loaded in: `dtype`, except an FP8 layer's weight (e4m3)
    and scales (float32)."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    return getattr(module, "LOAD_DTYPES", {}).get(attr, dtype)


def is_fp8(module: nn.Module) -> bool:
    return isinstance(module, FP8Mixin)


class RowStack:
    """Linears with the same input stacked along the output axis, run as one GEMM (q/k/v,
    gate/up). Each linear's weight (and bias, and FP8 scale) becomes a view of the stack, so
    the fused copy costs no memory. A plain object, not an nn.Module: the model's parameters
    stay the checkpoint's."""

    def __init__(self, *linears: nn.Linear):
        self.fp8 = is_fp8(linears[0])
        self.weight = _stack(linears, "weight")  # [sum out, in]
        self.bias = _stack(linears, "bias") if linears[0].bias is not None else None
        self.scale = _stack(linears, "weight_scale") if self.fp8 else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:  # fp8
            return fp8_linear(x, self.weight, self.scale, self.bias)
        return F.linear(x, self.weight, self.bias)

    def forward_fp8(self, x: FP8Act) -> FP8Out:
        """FP8 stacks only: the GEMM on a quantized input [M, in], raw output [M, sum out]."""
        assert self.scale is not None, "an FP8 stack's"
        return FP8Out(fp8_gemm_raw(x.data, self.weight), x.scale, self.scale, self.bias)


def _stack(linears, attr: str) -> torch.Tensor:
    whole = torch.cat([getattr(lin, attr).detach() for lin in linears])
    start = 0
    for lin in linears:
        stop = start + getattr(lin, attr).shape[0]
        setattr(lin, attr, nn.Parameter(whole[start:stop], requires_grad=False))
        start = stop
    return whole


def stack_rows(*linears: nn.Linear) -> RowStack | None:
    """One GEMM for these linears; None when some are FP8 and some float (a checkpoint that
    leaves only some of them unquantized): they then run one by one."""
    if len({is_fp8(lin) for lin in linears}) > 1:
        return None
    return RowStack(*linears)
