"""The small-M linear kernel (runtime/models/kernels/gemv.py) against its eager references,
under the Triton interpreter on the CPU (TRITON_INTERPRET=1 is set before triton loads):
float and e4m3 weights, bias, the folded SiLU(gate) * up, ragged shapes; and whole FP8 and
float models whose decode / verify linears run through it (counted) equal the eager path."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[3]

CASES = r'''
import torch
import torch.nn.functional as F
from runtime.models import fused, quant
from runtime.models.kernels.gemv import gemv

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
'''

MODEL_CASE = r'''
import sys
import torch
from runtime.models import kernels, load_model
from runtime.models.kernels import gemv as gemv_module

path, quantization = sys.argv[1], sys.argv[2] or None
calls = []
kernel = gemv_module.gemv
gemv_module.gemv = lambda *a, **kw: calls.append(kw.get("silu_mul", False)) or kernel(*a, **kw)
eager, fast = (load_model(path, torch.float32, "cpu", quantization=quantization)
               for _ in range(2))
for model in (eager, fast):
    model.allocate_cache(4, 64)
n_layers = len(fast.model.layers)
slots = torch.tensor([2, 0, 3])
steps = [(torch.randint(0, 96, (3, 5)), torch.zeros(3, dtype=torch.long),
          torch.tensor([5, 3, 4])),                                   # 15 rows: the kernel
         (torch.randint(0, 96, (3, 2)), torch.tensor([5, 3, 4]), torch.tensor([2, 1, 0])),
         (torch.randint(0, 96, (3, 9)), torch.tensor([7, 4, 4]), torch.tensor([9, 9, 9]))]
for i, (ids, start, n) in enumerate(steps):
    kernels.disable()
    want = eager.forward_static(ids, slots, start, n, kv_len=64)
    assert kernels.enable(torch.device("cpu"))
    calls.clear()
    got = fast.forward_static(ids, slots, start, n, kv_len=64)
    ok = torch.arange(ids.shape[1])[None, :] < n[:, None]
    err = (got[ok] - want[ok]).abs().max().item()
    assert err < 1e-4, err
    # qkv, o_proj, gate_up, down_proj (SiLU folded in) per layer; 27 rows: none
    expect = [] if ids.numel() > 16 else [False, False, False, True] * n_layers
    assert calls == expect, (i, calls)
print("ok")
'''


def run(code: str, *args: str, gemv: str = "fp8") -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", TANDEM_GEMV=gemv)
    res = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, text=True,
                         capture_output=True, timeout=280)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]


def test_gemv_equals_its_references():
    run(CASES)


@pytest.mark.parametrize("quantization,gemv", [("fp8", "fp8"), ("", "all")])
def test_model_linears_through_the_gemv_equal_eager(llama_path, quantization, gemv):
    """FP8 weights (TANDEM_GEMV=fp8, the default) and float weights (all): every linear of
    a decode / verify step but the LM head runs as the kernel, SiLU folded into down_proj;
    logits equal the eager path's; a 27-row step takes the library GEMMs."""
    run(MODEL_CASE, llama_path, quantization, gemv=gemv)


def test_gemv_setting_is_checked():
    env = dict(os.environ, TANDEM_GEMV="yes")
    res = subprocess.run([sys.executable, "-c", "import runtime.models.kernels"], cwd=ROOT,
                         env=env, text=True, capture_output=True, timeout=120)
    assert res.returncode != 0 and "TANDEM_GEMV must be 0, fp8 or all" in res.stderr
