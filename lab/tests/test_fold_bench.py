"""lab/gpu/fold_bench.py's comparison on the CPU under the Triton interpreter: the RoPE
kernel then slot_attention against slot_attention of the step's NewTokens, 8b heads over a
short cache, bf16 and the FP8 path's raw output; its `equal` must hold (the GPU run reports
the same check with its timings)."""

from __future__ import annotations

import pytest

from tests.interpreted import run_interpreted

pytestmark = pytest.mark.timeout(300)

CASES = r"""
import torch
from lab.gpu.fold_bench import case

torch.manual_seed(0)
for fp8 in (False, True):
    # tokens at positions 63 and 64: the second opens the next 64-position chunk
    r = case(1, 2, 65, fp8, torch.device("cpu"), lambda fn: 0.0, cache_len=255)
    assert r["equal"] is True, r
print("ok")
"""


def test_fold_bench_forms_are_equal():
    run_interpreted(CASES)
