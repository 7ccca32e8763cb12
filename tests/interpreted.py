"""Run a test's script in a fresh interpreter under the Triton interpreter (TRITON_INTERPRET=1
must be set before triton is first imported, so the Triton kernel tests cannot run in the
pytest process itself)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def count_calls(module, names: tuple[str, ...]) -> list:
    """Wrap these functions of `module` so that each call appends to the returned list (a
    script's check of which kernels ran)."""
    calls: list = []
    for name in names:

        def counted(*args, _fn=getattr(module, name)):  # noqa: B008 - bound per name
            calls.append(1)
            return _fn(*args)

        setattr(module, name, counted)
    return calls


def run_interpreted(code: str, *args: str, timeout: float = 280) -> None:
    """`python -c code args...` from the repository root with TRITON_INTERPRET=1; asserts it
    exits 0 having printed exactly "ok" (its stderr's tail otherwise)."""
    start_interpreted(code, *args).check(timeout)


class Interpreted:
    """One interpreted script started in the background (start_interpreted); check() waits
    for it and asserts what run_interpreted asserts. The scripts are single-threaded Python
    for the most part, so a file's scripts started together share the host's cores instead of
    taking turns on one."""

    def __init__(self, code: str, *args: str):
        env = dict(os.environ, TRITON_INTERPRET="1")
        self.out = tempfile.TemporaryFile("w+")
        self.err = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            cwd=ROOT,
            env=env,
            text=True,
            stdout=self.out,
            stderr=self.err,
        )

    def check(self, timeout: float = 280) -> None:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"interpreted script ran past {timeout} s") from None
        self.out.seek(0)
        self.err.seek(0)
        stdout, stderr = self.out.read(), self.err.read()
        assert code == 0 and stdout.strip() == "ok", stderr[-3000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def start_interpreted(code: str, *args: str) -> Interpreted:
    """Start `python -c code args...` as run_interpreted does, without waiting for it."""
    return Interpreted(code, *args)
