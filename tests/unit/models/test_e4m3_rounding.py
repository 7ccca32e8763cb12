"""runtime/models/kernels/e4m3.py's rounding under the Triton interpreter on the CPU: bit for bit
torch's round-to-nearest-even cast to e4m3 (the interpreter's own cast is not)."""

from __future__ import annotations

import pytest

from tests.interpreted import run_interpreted

pytestmark = pytest.mark.timeout(300)

CASES = r"""
import torch
import triton
import triton.language as tl
from runtime.models.kernels.e4m3 import e4m3_rne

FP8 = torch.float8_e4m3fn
torch.manual_seed(0)


@triton.jit
def _round_kernel(v_ptr, out_ptr, N: tl.constexpr):
    cols = tl.arange(0, N)
    tl.store(out_ptr + cols, e4m3_rne(tl.load(v_ptr + cols)).to(out_ptr.dtype.element_ty))


# every e4m3 value, the midpoints between neighbours (ties), points beside them, random
# values, signed zeros and subnormals
grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
grid = grid[grid.isfinite()].unique()                                  # sorted, -448..448
mids = (grid[1:] + grid[:-1]) / 2
values = torch.cat([grid, mids, mids.nextafter(grid[1:]), mids.nextafter(grid[:-1]),
                    torch.tensor([0.0, -0.0, 1e-9, -1e-9, 2.0 ** -10, -(2.0 ** -10)]),
                    (torch.rand(2000) * 2 - 1) * 448])
n = triton.next_power_of_2(values.numel())
values = torch.cat([values, torch.zeros(n - values.numel())])
got = torch.empty(n, dtype=FP8)
_round_kernel[(1,)](values, got, N=n)
bad = (got.view(torch.uint8) != values.to(FP8).view(torch.uint8)).nonzero()
assert bad.numel() == 0, values[bad[:5, 0]]
print("ok")
"""


def test_e4m3_rounding_equals_torch_cast():
    run_interpreted(CASES)
