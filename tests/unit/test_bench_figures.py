"""The bench's derived figures that need no run: decode_efficiency leaves each call's first
token out of the speed-up that `efficiency` counts."""

from __future__ import annotations

import pytest

from runtime.bench.figures import _decode_efficiency


def test_decode_efficiency_leaves_the_first_token_out():
    # target: 1.0 s of prefill, then 100 tokens in 2.0 s; spec: the same prefill, 1.0 s
    target = {
        "wall_s": 3.0,
        "generated_tokens": 100,
        "tokens_per_s": 100 / 3.0,
        "time_to_first_token_s": [1.0],
    }
    spec = {
        "wall_s": 2.0,
        "generated_tokens": 100,
        "time_to_first_token_s": [1.0],
        "theoretical_speedup": 2.5,
    }
    _decode_efficiency(spec, target)
    assert spec["decode_efficiency"] == pytest.approx(2.0 / 2.5)  # decode: 2x
    assert (target["wall_s"] / spec["wall_s"]) / 2.5 == pytest.approx(0.6)  # with prefill


def test_decode_efficiency_needs_both_first_tokens_and_a_theory():
    target = {
        "wall_s": 3.0,
        "generated_tokens": 100,
        "tokens_per_s": 33.0,
        "time_to_first_token_s": [None],
    }
    spec = {
        "wall_s": 2.0,
        "generated_tokens": 100,
        "time_to_first_token_s": [1.0],
        "theoretical_speedup": 2.5,
    }
    _decode_efficiency(spec, target)
    _decode_efficiency(spec, None)
    assert "decode_efficiency" not in spec
