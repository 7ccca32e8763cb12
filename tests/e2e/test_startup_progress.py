"""Startup progress of a real `tandem run` (spawn launch, two CPU workers): each phase is
reported once, in order; plain lines when stderr is a pipe or with --quiet, tqdm bars on a
terminal (a pseudo-terminal here)."""

from __future__ import annotations

import os
import pty
import re
import signal
import subprocess
import sys
import threading

import pytest

from tests import checkpoints, launch

pytestmark = pytest.mark.timeout(400)
TIMEOUT_S = 150


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("progress")
    target = checkpoints.build_checkpoint(root / "target", "llama", seed=0)
    return launch.write_config(root / "c.yaml", target, target)


def tandem_run(config: str, *flags: str, tty: bool) -> tuple[int, str]:
    """(exit code, stderr) of `tandem run`, its stderr a pipe or a pseudo-terminal."""
    args = [
        sys.executable,
        "-m",
        "launcher",
        "run",
        config,
        "--prompt-ids",
        "1,2",
        "--max-new-tokens",
        "3",
        *flags,
    ]
    if not tty:
        res = launch.run(
            "spawn",
            3,
            ["run", config, "--prompt-ids", "1,2", "--max-new-tokens", "3", *flags],
            timeout=TIMEOUT_S,
        )
        return res.returncode, res.stderr
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=slave,
        start_new_session=True,
        env=launch.clean_env(),
    )
    os.close(slave)
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer (workers too) has closed it
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(
            f"tandem run timed out:\n{b''.join(chunks).decode()[-3000:]}"
        ) from None
    finally:
        reader.join(10)
        os.close(master)
    launch.assert_group_gone(proc.pid)
    return code, b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")


def phase_lines(stderr: str) -> list[str]:
    """The progress lines, times and slow-rank notices left out."""
    out = []
    for line in stderr.splitlines():
        if line.startswith("tandem: ") and "waiting for rank" not in line:
            out.append(re.sub(r" in [\d.]+ s$", "", line))
    return out


EXPECTED = [
    "tandem: loading weights (2 workers)",  # no CUDA graphs on CPU
    "tandem: loading weights: 42/42 tensors",  # 21 per worker
    "tandem: ready: 2 workers",
]


@pytest.mark.parametrize(
    "flags, tty", [((), False), (("--quiet",), True)], ids=["pipe", "quiet-terminal"]
)
def test_plain_lines_each_phase_once_in_order(config, flags, tty):
    code, stderr = tandem_run(config, *flags, tty=tty)
    assert code == 0, stderr[-3000:]
    assert phase_lines(stderr) == EXPECTED, stderr[-3000:]
    assert "%|" not in stderr and "\r" not in stderr


def test_terminal_gets_bars(config):
    code, stderr = tandem_run(config, tty=True)
    assert code == 0, stderr[-3000:]
    segments = [s for s in re.split(r"[\r\n]", stderr) if s.startswith("tandem: ")]
    bars = [s for s in segments if s.startswith("tandem: loading weights:")]
    assert bars and "100%|" in bars[-1] and "42/42" in bars[-1], stderr[-3000:]
    assert "tandem: loading weights (2 workers)" not in segments
    ready = [i for i, s in enumerate(segments) if s.startswith("tandem: ready: 2 workers")]
    assert len(ready) == 1 and ready[0] > segments.index(bars[-1])
