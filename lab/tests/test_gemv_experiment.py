"""The experimental small-M linear (lab/gpu/gemv_kernel.py; the runtime does not use it,
docs/benchmarks.md says why) against its eager references under the Triton interpreter on the
CPU: float and e4m3 weights, bias, the folded SiLU(gate) * up, ragged shapes, both the
CUDA-core (<= 4 rows) and tensor-core paths and the split-K reduction."""

from __future__ import annotations

import pytest

from tests.interpreted import run_interpreted

pytestmark = pytest.mark.timeout(300)

CASES = r"""
import torch
import torch.nn.functional as F
from runtime.models.arch import fused, quant
from lab.gpu.gemv_kernel import gemv

torch.manual_seed(0)


def check(got, want, tol):
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape)
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol, err


for m, n, k in [(1, 48, 64), (3, 40, 72), (16, 33, 100)]:   # N, K not multiples of a tile
    x, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
    check(gemv(x, w), F.linear(x, w), 1e-4)                         # float weight
    check(gemv(x, w, None, b), F.linear(x, w, b), 1e-4)
    w8, s = quant.quantize_rows(w)                                   # e4m3, per channel
    check(gemv(x, w8, s, b), quant.fp8_linear(x, w8, s, b), 1e-4)    # = weight-only path
    gate_up = torch.randn(m, 2 * k)
    check(gemv(gate_up, w8, s, silu_mul=True),
          F.linear(fused.silu_mul(gate_up), quant.dequantize(w8, s)), 1e-4)
    h = x.half()                                                     # half activations
    check(gemv(h, w8, s), F.linear(h.float(), quant.dequantize(w8, s)).half(), 2e-2)

x3 = torch.randn(2, 3, 64)                                           # leading dims kept
check(gemv(x3, torch.eye(64)), x3, 1e-6)
for bad in (torch.randn(17, 64), torch.randn(2, 63)):                # too many rows, wrong K
    try:
        gemv(bad, torch.randn(8, 64))
    except ValueError as e:
        assert "gemv" in str(e)
    else:
        raise AssertionError("accepted " + str(tuple(bad.shape)))
print("ok")
"""


def test_gemv_experiment_equals_its_references():
    run_interpreted(CASES)
