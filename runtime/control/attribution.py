"""What the worker pool knows of its ranks' health, and which rank a failure is blamed on.

When one rank dies, its peers usually fail first in a collective ("connection reset by
peer") and report that error; the pool then names the rank that died without a word as the
cause (a child that exited, a rank on this host whose process is gone, or one whose
heartbeats stopped), not the peer. Attribution holds what that takes: when each rank was last
heard from, its process, the errors ranks reported; runtime.control.pool.WorkerPool is one.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Collection

from runtime.control.procwatch import proc_stat
from runtime.errors import EngineDeadError

log = logging.getLogger("tandem.pool")

Liveness = Callable[..., "str | None"]  # liveness(exclude=ranks) -> why a rank is gone


class Attribution:
    """The ranks' last signs of life and reported failures (the pool's base: its sockets,
    runtime.control.channel, mark ranks seen and record their errors here)."""

    def __init__(
        self,
        worker_ranks: tuple[int, ...],
        heartbeat_s: float,
        dead_after_s: float,
        liveness: Liveness | None,
    ):
        self.ranks = tuple(worker_ranks)
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self.liveness = liveness  # returns a message when a child process has died
        now = time.monotonic()
        self.last_seen = {r: now for r in self.ranks}
        self.promised = {r: heartbeat_s for r in self.ranks}  # rank -> its next heartbeat's
        # delay, as it said last
        self.dead: str | None = None
        self.processes: dict[int, tuple[str, int]] = {}  # rank -> (host, pid), from hello
        self.failures: dict[int, str] = {}  # rank -> the error it reported
        self.usage_failures: set[int] = set()  # ... of kind "usage" (the config's)
        self._failed_at: float | None = None

    def _die(self, reason: str) -> None:
        if self.dead is None:
            self.dead = reason
        raise EngineDeadError(self.dead)

    def _worker_failed(self, rank: int, message: str) -> None:
        """A rank reported an error: check_alive (next, once the queue is drained) dies
        naming the rank that caused it if one is gone, else gives the cause
        ATTRIBUTION_GRACE_S to show."""
        log.info("rank %s reported an error: %s", rank, message)  # reported by _die
        self.failures.setdefault(rank, message)
        if self._failed_at is None:
            self._failed_at = time.monotonic()

    def usage_error(self) -> str | None:
        """When every failure a rank reported is a problem of the config (kind "usage":
        e.g. a KV cache over its budget), the first of them; else None (a crash)."""
        if not self.failures or set(self.failures) != self.usage_failures:
            return None
        return next(iter(self.failures.values()))

    def _failure_summary(self) -> str:
        first = next(iter(self.failures.values()))
        more = len(self.failures) - 1
        return first + (f" (and {more} more rank(s) failed)" if more else "")

    def _gone(self, exclude: Collection[int] = ()) -> str | None:
        """Why a rank not in `exclude` is gone: a child process that exited (liveness), a
        rank on this host whose process no longer runs, or one whose heartbeats stopped a
        few periods ago (stopped or hung). None if all look alive. Only used to name the
        cause of a failure, never to declare one."""
        if self.liveness is not None:
            reason = self.liveness(exclude=exclude)
            if reason:
                return reason
        host = socket.gethostname()
        for rank, (where, pid) in sorted(self.processes.items()):
            if rank not in exclude and where == host and not _process_runs(pid):
                reason = self._exit_status(rank)
                return reason or f"rank {rank} (pid {pid}) died"
        now = time.monotonic()
        for rank, seen in sorted(self.last_seen.items()):
            if rank not in exclude and now - seen > max(2 * self.promised[rank], 1.5):
                return f"rank {rank} sent no heartbeat for {now - seen:.0f} s"
        return None

    def _exit_status(self, rank: int, wait_s: float = 0.5) -> str | None:
        """How our child `rank` ended (signal or exit code), once it can be reaped: the
        kernel may still be tearing it down, or another thread may hold its wait lock."""
        if self.liveness is None:
            return None
        deadline = time.monotonic() + wait_s
        while True:
            reason = self.liveness(exclude=set(self.ranks) - {rank})
            if reason or time.monotonic() > deadline:
                return reason
            time.sleep(0.01)


def _process_runs(pid: int) -> bool:
    """Whether process `pid` of this host is running (not gone, not a zombie)."""
    fields = proc_stat(pid)
    if not fields:
        return not os.path.isdir("/proc/self")  # no procfs: cannot tell, assume it runs
    return fields[0] not in ("Z", "X", "x")
