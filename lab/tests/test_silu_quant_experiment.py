"""The experimental one-launch SiLU·up + per-token e4m3 quantize (lab/gpu/
silu_quant_kernel.py; the runtime does not use it) against runtime.models.arch.fused.silu_mul_fp8
under the Triton interpreter on the CPU: ragged rows (a program past the row's end), bias,
float32 activations (and bf16, loosely: the interpreter truncates bf16), and calls reusing the
buffers (the counters end at 0)."""

from __future__ import annotations

import pytest

from tests.interpreted import run_interpreted

pytestmark = pytest.mark.timeout(300)

CASES = r"""
import torch
from runtime.models.arch import fused
from lab.gpu.silu_quant_kernel import SiluQuant

torch.manual_seed(0)
# float32 activations: the eager sequence's values (up to the last bit of exp); bf16: the
# interpreter's bf16 casts truncate instead of rounding to nearest, so only roughly
# final: the last program's quantize loop in steps of other sizes than a program's columns
for tokens, inter, block, dtype, bias, final in [(1, 256, 64, torch.float32, False, None),
                                                 (3, 130, 32, torch.float32, True, 128),
                                                 (5, 200, 64, torch.float32, False, 16),
                                                 (3, 130, 32, torch.bfloat16, True, None)]:
    exact = dtype == torch.float32
    ours = SiluQuant(tokens, inter, dtype, "cpu", block=block, final=final)
    assert ours.programs & (ours.programs - 1) == 0
    for call in range(2):                          # the second call reuses the buffers
        raw = torch.randn(tokens, 2 * inter) * 30
        xs, ws = torch.rand(tokens, 1) / 10, torch.rand(2 * inter) / 10
        b = torch.randn(2 * inter).to(dtype) if bias else None
        q, scale = ours(raw, xs, ws, b)
        want_q, want_scale = fused.silu_mul_fp8(raw, xs, ws, b, dtype)
        assert q.dtype == torch.float8_e4m3fn and q.shape == want_q.shape
        rtol = 1e-6 if exact else 2 ** -5
        assert torch.allclose(scale, want_scale, rtol=rtol, atol=0), (scale, want_scale)
        steps = (q.float() * scale - want_q.float() * want_scale).abs()
        spacing = want_q.float().abs().clamp(min=2 ** -6) * want_scale / 8   # e4m3: 3 bits
        assert bool((steps <= spacing * (1.01 if exact else 2.5)).all()), steps.max()
        if exact:       # the same e4m3 values but where exp's last bit moved a rounding
            assert (q.float() != want_q.float()).float().mean().item() < 0.01
        assert int(ours.counters.abs().sum()) == 0
        # the scratch row is silu(gate) * up in the activation dtype
        h = fused.silu_mul(fused.fp8_rescale(raw, xs, ws, b, dtype))
        assert (ours.h.float() - h.float()).abs().max().item() <= \
            h.float().abs().max().item() * (1e-6 if exact else 2 ** -4)
print("ok")
"""


def test_silu_quant_kernel_interpreted():
    run_interpreted(CASES)
