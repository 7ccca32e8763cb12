"""The FP8 activation kernels (runtime/models/kernels/fp8_act.py) against their eager
references in runtime.models.fused, under the Triton interpreter on the CPU: the e4m3 rounding
bit for bit against torch's cast, the norm and SiLU·up kernels against add_rms_norm_fp8 /
rms_norm_fp8 / silu_mul_fp8 (the residual sums bit for bit; the quantized rows to within the
reduction order's last bits)."""
from __future__ import annotations

import pytest

from tests.interpreted import run_interpreted

pytestmark = pytest.mark.timeout(300)

CASES = r'''
import torch
import triton
import triton.language as tl
from runtime.models import fused
from runtime.models.kernels import fp8_act

FP8 = torch.float8_e4m3fn
torch.manual_seed(0)


@triton.jit
def _round_kernel(v_ptr, out_ptr, N: tl.constexpr):
    cols = tl.arange(0, N)
    rounded = fp8_act.e4m3_rne(tl.load(v_ptr + cols))
    tl.store(out_ptr + cols, rounded.to(out_ptr.dtype.element_ty))


def rounding():
    """Every e4m3 value, the midpoints between neighbours (ties), points beside them, random
    values, signed zeros and subnormals: the bytes of torch's round-to-nearest-even cast."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite()].unique()                              # sorted, -448..448
    mids = (grid[1:] + grid[:-1]) / 2
    values = torch.cat([grid, mids, mids.nextafter(grid[1:]), mids.nextafter(grid[:-1]),
                        torch.tensor([0.0, -0.0, 1e-9, -1e-9, 2.0 ** -10, -(2.0 ** -10)]),
                        (torch.rand(2000) * 2 - 1) * 448])
    n = triton.next_power_of_2(values.numel())
    values = torch.cat([values, torch.zeros(n - values.numel())])
    got = torch.empty(n, dtype=FP8)
    _round_kernel[(1,)](values, got, N=n)
    want = values.to(FP8)
    bad = (got.view(torch.uint8) != want.view(torch.uint8)).nonzero()
    assert bad.numel() == 0, values[bad[:5, 0]]


def close_fp8(got, want, exact=False):
    """Quantized rows equal up to the reduction order: scales to 1e-6, e4m3 values
    within one step of theirs, nearly all bytes equal; `exact`: bit for bit."""
    (g8, gs), (w8, ws) = got, want
    assert g8.dtype == FP8 and g8.shape == w8.shape and gs.shape == ws.shape
    if exact:
        assert torch.equal(g8.view(torch.uint8), w8.view(torch.uint8)) and torch.equal(gs, ws)
    assert ((gs - ws).abs() <= 1e-6 * ws.abs()).all(), (gs, ws)
    diff = (g8.float() - w8.float()).abs()
    assert (diff <= w8.float().abs() / 8 + 2.0 ** -9).all()
    same = (g8.view(torch.uint8) == w8.view(torch.uint8)).float().mean().item()
    assert same >= 0.99, same


def gemm_out(m, n, dtype, bias):
    raw = torch.randn(m, n) * 300
    return (raw, torch.rand(m, 1) * 0.01 + 1e-3, torch.rand(n) * 0.01 + 1e-3,
            (torch.randn(n) * 0.5).to(dtype) if bias else None)


def norms(m, k, dtype, bias):
    x = torch.randn(m, k).to(dtype)
    w = (torch.rand(k) + 0.5).to(dtype)
    raw, xs, ws, b = gemm_out(m, k, dtype, bias)
    want = fused.add_rms_norm_fp8(x, raw, w, 1e-5, xs, ws, b)          # raw delta
    got = fp8_act.add_rms_norm_fp8(x, raw, w, 1e-5, xs, ws, b)
    assert torch.equal(got[0], want[0])
    close_fp8(got[1:], want[1:])
    delta = torch.randn(m, k).to(dtype)                                 # delta in dtype
    want = fused.add_rms_norm_fp8(x, delta, w, 1e-5)
    got = fp8_act.add_rms_norm_fp8(x, delta, w, 1e-5)
    assert torch.equal(got[0], want[0])
    close_fp8(got[1:], want[1:])
    close_fp8(fp8_act.rms_norm_fp8(x, w, 1e-5), fused.rms_norm_fp8(x, w, 1e-5))
    assert fp8_act.fits_norm(x, delta) and not fp8_act.fits_norm(x.t(), None)


def silu(m, i, dtype, bias):
    """No sum to reorder: in float16 bit for bit (the SiLU rounded where eager rounds it)."""
    args = gemm_out(m, 2 * i, dtype, bias)
    close_fp8(fp8_act.silu_mul_fp8(*args, dtype), fused.silu_mul_fp8(*args, dtype),
              exact=dtype == torch.float16)
    assert fp8_act.fits_silu(args[0], dtype)


# bfloat16 is left to the GPU check: the interpreter's float32 -> bfloat16 cast truncates
# (it rounds half the values of torch.randn otherwise than torch and the GPU do)
rounding()
norms(3, 64, torch.float32, True)
norms(2, 96, torch.float16, False)      # K not a power of two: masked columns
norms(1, 128, torch.float16, True)
silu(3, 96, torch.float32, True)
silu(1, 64, torch.float16, False)
silu(2, 48, torch.float16, True)
silu(4, 4096, torch.float16, True)      # enough values for a rounding point to show
assert not fp8_act.fits_silu(torch.zeros(1, 2 * fp8_act.MAX_BLOCK + 2), torch.float16)
print("ok")
'''


def test_fp8_activation_kernels_equal_the_fused_references():
    run_interpreted(CASES)
