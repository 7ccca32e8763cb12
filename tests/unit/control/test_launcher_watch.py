"""A rank started by a launcher ends with it (launcher/orphan.py over
runtime.control.procwatch.watch_parent): a stand-in launcher (a small Python process) starts
a stand-in rank, the test SIGKILLs the launcher and times the rank's end. CPU only, no torch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.processes import kill_all, running, wait_gone

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[3]
BOUND_S = 3.0  # the rank ends this soon (docs: within the 10 s liveness bound)

# the stand-in launcher: starts the rank (from a thread that then ends, as PR_SET_PDEATHSIG
# would wrongly take for the parent's death), prints its pid and sleeps
LAUNCHER = """
import subprocess, sys, threading, time
procs = []
t = threading.Thread(target=lambda: procs.append(subprocess.Popen(sys.argv[1:])))
t.start(); t.join()
print(procs[0].pid, flush=True)
time.sleep(120)
"""

# the stand-in rank: arg 1 the launch method, arg 2 its rank, arg 3 "nopidfd" to take the
# polling way; rank 0 notes its SIGTERM in the file of arg 4 and then exits (or, with
# "stubborn", ignores it and is ended by the grace period)
RANK = """
import os, signal, sys, time
method, rank, mode, note = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
from launcher import orphan
from runtime.control import procwatch
orphan.ORPHAN_GRACE_S = 0.5
if mode == "nopidfd":
    def no_pidfd(pid): raise OSError("no pidfds here")
    os.pidfd_open = no_pidfd
def on_term(signum, frame):
    open(note, "w").write("SIGTERM")
    if mode != "stubborn":
        os._exit(0)
signal.signal(signal.SIGTERM, on_term)
orphan.end_with_launcher(method, rank)
open(note + ".ready", "w").write("ready")
time.sleep(120)
"""


def _launch(tmp_path: Path, method: str, rank: int, mode: str = "pidfd"):
    """(launcher process, rank pid, note file) once the rank watches its launcher."""
    note = tmp_path / "note"
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            LAUNCHER,
            sys.executable,
            "-c",
            RANK,
            method,
            str(rank),
            mode,
            str(note),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        start_new_session=True,
    )
    pid = int(launcher.stdout.readline())
    deadline = time.monotonic() + 30
    while not Path(str(note) + ".ready").exists():
        assert time.monotonic() < deadline and running(pid), "the rank did not start"
        time.sleep(0.05)
    return launcher, pid, note


@pytest.fixture
def started(tmp_path):
    made = []

    def start(*args, **kwargs):
        made.append(_launch(tmp_path, *args, **kwargs))
        return made[-1]

    yield start
    for launcher, pid, _ in made:
        kill_all([launcher.pid, pid])
        launcher.wait(10)


def _kill_launcher(launcher: subprocess.Popen) -> None:
    launcher.kill()
    launcher.wait(10)


@pytest.mark.parametrize("method", ["torchrun", "mpi", "child"])
@pytest.mark.parametrize("mode", ["pidfd", "nopidfd"])
def test_worker_exits_when_its_launcher_is_killed(started, method, mode):
    launcher, pid, note = started(method, 2, mode)
    time.sleep(0.3)
    assert running(pid), "a worker must outlive the thread that started it"
    _kill_launcher(launcher)
    assert wait_gone([pid], BOUND_S) < BOUND_S
    assert not note.exists()  # a worker exits at once, no SIGTERM to itself


def test_rank0_stops_in_order(started):
    """Rank 0 signals itself SIGTERM (its serve / run loop stops as on a user's signal)."""
    launcher, pid, note = started("torchrun", 0)
    _kill_launcher(launcher)
    wait_gone([pid], BOUND_S)
    assert note.read_text() == "SIGTERM"


def test_rank0_exits_after_the_grace_period(started):
    """A rank 0 that does not stop on SIGTERM (still starting) exits ORPHAN_GRACE_S later."""
    launcher, pid, note = started("mpi-spawn", 0, "stubborn")
    _kill_launcher(launcher)
    wait_gone([pid], BOUND_S)
    assert note.read_text() == "SIGTERM"


def test_plain_launch_watches_nothing(started):
    """`tandem run` from a user's shell (launch method spawn) outlives that shell."""
    launcher, pid, _ = started("spawn", 0)
    _kill_launcher(launcher)
    time.sleep(1.5)
    assert running(pid)
    os.kill(pid, signal.SIGKILL)
