"""Processes of a launch, seen from the test: a launch's ranks by pid, waiting for them to be
gone, and killing whatever is left (Linux /proc)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state) of a process, None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0]


def running(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[1] not in ("Z", "X", "x")


def descendants(root: int) -> set[int]:
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                parents.setdefault(st[0], []).append(int(entry))
    out, todo = set(), [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _rank(pid: int) -> int | None:
    """The tandem rank of a process (spawned worker, torchrun or MPI rank), else None."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            args = fh.read().decode(errors="replace").split("\0")
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = dict(
                kv.split("=", 1)
                for kv in fh.read().decode(errors="replace").split("\0")
                if "=" in kv
            )
    except OSError:
        return None
    if (
        not os.path.basename(args[0]).startswith("python")
        or "launcher" not in args
        or os.path.basename(args[1]) == "torchrun"
    ):
        return None  # not a rank: torchrun's agent, mpirun, hydra, ...
    if "--rank" in args:
        return int(args[args.index("--rank") + 1])
    for key in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if key in env:
            return int(env[key])
    return 0 if "serve" in args or "run" in args else None


def ranks_of(root: int, world: int, timeout_s: float = 60) -> dict[int, int]:
    """rank -> pid of every rank under `root` (the launched process itself may be rank 0)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = {}
        for pid in descendants(root) | {root}:
            rank = _rank(pid)
            if rank is not None and running(pid):
                found[rank] = pid
        if len(found) >= world or time.monotonic() > deadline:
            assert len(found) == world, f"expected {world} ranks under {root}, found {found}"
            return found
        time.sleep(0.1)


def wait_gone(pids, timeout_s: float) -> float:
    """Seconds until none of `pids` runs (zombies count as gone); AssertionError after
    timeout_s."""
    start = time.monotonic()
    while True:
        left = sorted(p for p in pids if running(p))
        elapsed = time.monotonic() - start
        if not left:
            return elapsed
        if elapsed > timeout_s:
            raise AssertionError(f"processes {left} still running after {timeout_s} s")
        time.sleep(0.05)


def kill_all(pids) -> None:
    """Cleanup: continue and kill whatever of `pids` (and their children) still runs."""
    pids = set(pids)
    for pid in list(pids):
        if running(pid):
            pids |= descendants(pid)
    for pid in pids:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def socket_inodes(pid: int) -> set[str]:
    """The inodes of the sockets process `pid` holds open (its /proc/<pid>/fd links)."""
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(link[len("socket:[") : -1])
    return out
