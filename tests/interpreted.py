"""Run a test's script in a fresh interpreter under the Triton interpreter (TRITON_INTERPRET=1
must be set before triton is first imported, so the Triton kernel tests cannot run in the
pytest process itself)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(code: str, *args: str, timeout: float = 280) -> None:
    """`python -c code args...` from the repository root with TRITON_INTERPRET=1; asserts it
    exits 0 having printed exactly "ok" (its stderr's tail otherwise)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, text=True,
                         capture_output=True, timeout=timeout)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]
