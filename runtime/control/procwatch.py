"""Knowing at once when a process on this host ends, our child or not (under mpirun and
torchrun the workers are not the server's children, nor the server the client's): a pidfd
per process (Linux 5.3+), polled together with zmq sockets. Elsewhere nothing is watched and
heartbeats and silence limits still tell."""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from collections.abc import Callable, Hashable

import zmq


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state, parent pid, ...), or
    None when there is no such process (or no procfs)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def parent_pid(pid: int) -> int | None:
    """The parent of process `pid` on this host, or None if unknown."""
    fields = proc_stat(pid)
    try:
        return int(fields[1]) if fields else None
    except (IndexError, ValueError):
        return None


class ProcessWatch:
    def __init__(self, poller: zmq.Poller):
        self.poller = poller
        self.fds: dict[int, tuple[Hashable, int]] = {}  # pidfd -> (key, pid)
        # (key, pid, when seen), in order; ends seen in one poll share their time: which of
        # them came first cannot be told
        self.ended: list[tuple[Hashable, int, float]] = []

    def add(self, key: Hashable, host: str, pid: int) -> None:
        """Watch process `pid` if it runs on this host (and is not this process)."""
        if host != socket.gethostname() or pid == os.getpid():
            return
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.ended.append((key, pid, time.monotonic()))
            return
        except (AttributeError, OSError):  # no pidfd_open on this system
            return
        self.fds[fd] = (key, pid)
        self.poller.register(fd, zmq.POLLIN)

    def collect(self, ready: dict) -> None:
        """Note the watched processes whose pidfd is in `ready` (zmq.Poller.poll's result,
        as a dict) as ended, and stop watching them."""
        now = time.monotonic()
        for fd in [fd for fd in self.fds if fd in ready]:
            key, pid = self.fds.pop(fd)
            self.ended.append((key, pid, now))
            self._forget(fd)

    def close(self) -> None:
        for fd in list(self.fds):
            self._forget(fd)
        self.fds.clear()

    def _forget(self, fd: int) -> None:
        self.poller.unregister(fd)
        os.close(fd)


# --- a rank ends with its launcher -------------------------------------------------------
# torchrun's agent, mpirun's daemon (prted / orted / hydra's proxy) or tandem's own spawner
# starts each rank as its child; SIGKILLed (an OOM killer, a job scheduler), it can no longer
# end them. PR_SET_PDEATHSIG would fire when the parent *thread* that forked us ends, not the
# process, so the rank watches its parent process instead: a pidfd, waited on by a thread of
# its own (no wake-up while the parent lives), or where there are no pidfds the parent pid,
# looked at every PARENT_POLL_S.
PARENT_POLL_S = 1.0


def watch_parent(on_gone: Callable[[int], None], poll_s: float = PARENT_POLL_S) -> int | None:
    """Call on_gone(parent pid) on a daemon thread once this process's parent has ended (at
    once if it already has). Returns the parent's pid, or None when there is none to watch
    (init or a subreaper of pid 1 adopted us: we are an orphan from the start)."""
    ppid = os.getppid()
    if ppid <= 1:
        return None
    try:
        fd: int | None = os.pidfd_open(ppid)
    except (AttributeError, OSError):  # no pidfds (or the parent just ended: see below)
        fd = None
    if os.getppid() != ppid:  # it ended before the pidfd could be opened
        if fd is not None:
            os.close(fd)
        fd = -1
    threading.Thread(
        target=_await_parent,
        args=(ppid, fd, on_gone, poll_s),
        name="tandem-launcher-watch",
        daemon=True,
    ).start()
    return ppid


def _await_parent(ppid: int, fd: int | None, on_gone: Callable[[int], None], poll_s: float) -> None:
    if fd is not None and fd >= 0:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while not poller.poll():  # readable (POLLIN) once the process has ended
            pass
        os.close(fd)
    elif fd is None:
        while os.getppid() == ppid:  # reparented (to init or a subreaper) once it ends
            time.sleep(poll_s)
    on_gone(ppid)
