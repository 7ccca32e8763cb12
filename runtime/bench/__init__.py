"""`tandem bench`: target alone, tandem speculation and transformers baselines side by side.

modes.py lists the modes and times them (tandem_modes.py and hf_modes.py run them), metrics.py
measures and holds the formulas (c, theoretical speedup, roofline), figures.py derives each
row's figures, runner.py puts them together, report.py prints the table and writes the JSON.
"""

from __future__ import annotations

__all__ = ["BenchSettings", "run_bench", "MODES", "FIGURES"]


def __getattr__(name: str):  # lazy: `tandem --help` must not import torch
    if name in ("BenchSettings", "run_bench"):
        from runtime.bench import runner

        return getattr(runner, name)
    if name == "MODES":
        from runtime.bench.modes import MODES

        return MODES
    if name == "FIGURES":
        from runtime.bench.report import FIGURES

        return FIGURES
    raise AttributeError(f"module 'runtime.bench' has no attribute {name!r}")
