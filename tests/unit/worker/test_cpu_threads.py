"""CPU workers' threads (docs/configuration.md, "CPU threads"): the intra-op thread count
(runtime.cpu_threads, else 1, whatever the cores), and the OpenMP wait policy that
`python -m launcher run|serve|worker` puts in the environment before torch loads (PASSIVE:
idle threads sleep instead of spinning), unless the user set one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.worker.process import _bind_cpu_block, _cpu_threads

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def cores(monkeypatch):
    """Pretend this process may use `n` cores (no pinning: TANDEM_CPU_AFFINITY unset)."""
    monkeypatch.delenv("TANDEM_CPU_AFFINITY", raising=False)

    def allow(n: int) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)), raising=False)

    return allow


@pytest.mark.parametrize("n", [1, 2, 8, 64])
def test_auto_is_one_thread_whatever_the_cores(cores, n):
    cores(n)
    assert _cpu_threads(None) == 1


@pytest.mark.parametrize("threads", [1, 2, 3, 16])
def test_the_key_sets_the_threads_whatever_the_cores(cores, threads):
    cores(2)
    assert _cpu_threads(threads) == threads  # 16: more than the cores, as asked


def test_the_share_of_the_cores_with_fewer_cores_than_workers(cores):
    """The block a worker is pinned to with TANDEM_CPU_AFFINITY=1 (the threads are apart)."""
    cores(8)
    assert [_bind_cpu_block(i, 3) for i in range(3)] == [2, 2, 2]  # 8 // 3
    cores(2)
    assert [_bind_cpu_block(i, 3) for i in range(3)] == [1, 1, 1]


_ENTRY = """
import os, runpy, sys
sys.argv = ["tandem", *sys.argv[1:]]
try:
    runpy.run_module("launcher", run_name="__main__", alter_sys=True)
except SystemExit:
    pass
print("policy:", os.environ.get("OMP_WAIT_POLICY"))
import torch                        # its OpenMP runtime loads now, and shows its settings
"""


def _entry(*argv: str, **env: str) -> tuple[str, str]:
    """Run `python -m launcher ARGV` in a fresh interpreter, then import torch there; the
    policy in its environment after the entry, and libgomp's settings (on stderr)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    proc = subprocess.run(
        [sys.executable, "-c", _ENTRY, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
        env={**base, "OMP_DISPLAY_ENV": "VERBOSE", **env},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    policy = [line for line in proc.stdout.splitlines() if line.startswith("policy:")]
    return policy[-1].split(":", 1)[1].strip(), proc.stderr


@pytest.mark.parametrize("command", ["worker", "serve"])
def test_the_entry_makes_idle_threads_sleep(command):
    policy, omp = _entry(command, "--help")
    assert policy == "PASSIVE"
    if "GOMP_SPINCOUNT" in omp:  # torch's libgomp: it read the policy as it loaded
        assert "GOMP_SPINCOUNT = '0'" in omp, omp


def test_a_users_own_policy_wins():
    policy, omp = _entry("worker", "--help", OMP_WAIT_POLICY="ACTIVE")
    assert policy == "ACTIVE"
    if "GOMP_SPINCOUNT" in omp:
        assert "OMP_WAIT_POLICY = 'ACTIVE'" in omp and "GOMP_SPINCOUNT = '0'" not in omp, omp


def test_bench_keeps_torchs_defaults():
    """`python -m launcher bench` times its in-process modes as `tandem bench` does."""
    policy, omp = _entry("bench", "--help")
    assert policy == "None"
    if "GOMP_SPINCOUNT" in omp:
        assert "GOMP_SPINCOUNT = '0'" not in omp, omp
