"""A rank ends with its launcher. torchrun's agent, mpirun's daemon (prted / orted, hydra's
proxy) or tandem's own spawner starts each rank as its child; killed with SIGKILL (an OOM
killer, a job scheduler) it can no longer end them, and they would run on with no owner.
So a rank so started watches its parent (runtime.control.procwatch.watch_parent) and, once
it is gone:

- a worker exits at once (exit code 1): rank 0 and its peers then see a dead rank, as
  after any other death (docs/failures.md);
- rank 0 signals itself SIGTERM, as a user's stop would (the clients' calls fail, the
  workers are told to shut down), and exits anyway ORPHAN_GRACE_S later if still running.

A rank of a plain `tandem run` / `tandem serve` (launch method "spawn": its parent is a
user's shell or program) watches nothing; an Engine's server ends with the Engine by its own
pipe (launcher.session._watch_owner)."""

from __future__ import annotations

import logging
import os
import signal
import time

from runtime.control.procwatch import watch_parent

log = logging.getLogger("tandem.launcher")
LAUNCHED = ("torchrun", "mpi", "mpi-spawn", "child")  # launch methods with a launcher parent
ORPHAN_GRACE_S = 5.0  # rank 0: from its own SIGTERM to a hard exit (within the 10 s bound)
EXIT_ORPHANED = 1


def end_with_launcher(method: str, rank: int) -> int | None:
    """Watch this rank's launcher when `method` (launcher.discovery.LaunchEnv.method, or
    "child" for a worker started by rank 0) has one. Returns the watched pid, or None."""
    if method not in LAUNCHED:
        return None
    return watch_parent(lambda ppid: _launcher_gone(rank, ppid))


def _launcher_gone(rank: int, ppid: int) -> None:
    """On the watch's thread, once the launcher (pid `ppid`) has ended."""
    log.warning("rank %d: its launcher (pid %d) is gone; exiting", rank, ppid)
    if rank != 0:
        _exit_now()
    os.kill(os.getpid(), signal.SIGTERM)  # serve / run stop in order, as on a user's signal
    time.sleep(ORPHAN_GRACE_S)
    _exit_now()


def _exit_now() -> None:
    # no flushing: the main thread may hold a stream's lock, blocked writing (the logging
    # handler flushed the warning above already)
    os._exit(EXIT_ORPHANED)
