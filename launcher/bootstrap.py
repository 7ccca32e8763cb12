"""Bring the whole system up from rank 0 (and tear it down): start workers where this launch
form requires it, join the world group, hand out the control address, build the groups and
wait until every worker has loaded its shards."""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field

import zmq

from launcher.discovery import LaunchEnv
from parallel.topology import LaunchError, Topology
from runtime.config import TandemConfig
from runtime.control import auth
from runtime.control.pool import WorkerPool
from runtime.control.progress import StartupDisplay, rank_labels
from runtime.errors import EngineDeadError

log = logging.getLogger("tandem.launcher")
DEAD_GRACE_S = 3.0  # after a failure: how long shutdown waits for a worker before SIGKILL


class StartupUsageError(EngineDeadError):
    """Startup failed because the config asks for what a rank cannot do (its KV cache over
    the memory budget): a usage error (exit 2) in one line, not a crash."""


@dataclass
class Cluster:
    config: TandemConfig
    topology: Topology
    context: zmq.Context
    pool: WorkerPool
    store: object  # the rendezvous store, which the workers' world still uses
    procs: list[subprocess.Popen] = field(default_factory=list)
    mpi_children: object | None = None

    def shutdown(self, timeout_s: float = 20.0) -> None:
        """Ask every worker to exit, wait, then make sure no child is left. After a failure
        a live worker may be stuck in a collective with the dead rank (or stopped): wait
        only DEAD_GRACE_S for it before killing it."""
        self.pool.shutdown()  # also after a failure: the live workers exit at once
        if self.pool.dead is not None:
            timeout_s = min(timeout_s, DEAD_GRACE_S)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.pool.close()
        self.context.term()


def _pgroups():
    """parallel.groups, imported on first use: it imports torch (2-3 s of CPU), and rank 0
    should start its workers first, so that their imports and its own run at once."""
    from parallel import groups

    return groups


def _child_command(
    rank_arg: list[str], world_size: int, init_method: str, config: TandemConfig
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "launcher",
        "worker",
        *rank_arg,
        "--world-size",
        str(world_size),
        "--init-method",
        init_method,
        "--startup-timeout",
        str(config.runtime.startup_timeout_s),
    ]


_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def _spawn_workers(
    topology: Topology, init_method: str, config: TandemConfig, procs: list[subprocess.Popen]
) -> None:
    """Start a worker process per worker rank, each appended to `procs` at once. SIGINT and
    SIGTERM are held meanwhile: Popen's fork hooks (logging's among them) would swallow the
    KeyboardInterrupt of a Ctrl-C that came during a fork, with a traceback. A held signal
    comes once all are started, and the caller's cleanup kills them."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        for rank in topology.worker_ranks:
            cmd = _child_command(["--rank", str(rank)], topology.world_size, init_method, config)
            procs.append(
                subprocess.Popen(cmd, preexec_fn=lambda: _die_with_parent(held), env=_child_env())
            )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _child_env() -> dict:
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    return env


def _die_with_parent(mask) -> None:  # pragma: no cover - runs in the child before exec
    # a Ctrl-C to the process group is rank 0's to act on: the worker ignores SIGINT until it
    # installs its own handlers (worker.process), so one that lands while its interpreter
    # starts (importing site) cannot crash it with a traceback; rank 0 then ends it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # the worker gets SIGTERM again
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: orphaned workers die at once
    except OSError:
        pass


def _mpi_spawn_workers(topology: Topology, init_method: str, config: TandemConfig):
    from mpi4py import MPI

    cmd = _child_command(["--rank-from-mpi"], topology.world_size, init_method, config)
    intercomm = MPI.COMM_SELF.Spawn(cmd[0], args=cmd[1:], maxprocs=len(topology.worker_ranks))
    intercomm.Disconnect()  # the children rendezvous over torch.distributed from here on


def _procs_liveness(procs: list[subprocess.Popen], topology: Topology):
    def check(exclude: Collection[int] = ()) -> str | None:
        """Why a worker child (not in `exclude`) is gone; None while they all run."""
        for rank, proc in zip(topology.worker_ranks, procs):
            code = proc.poll() if rank not in exclude else None
            if code is not None:
                how = (
                    f"was killed by {_signal_name(-code)}"
                    if code < 0
                    else f"exited with code {code}"
                )
                return f"rank {rank} (pid {proc.pid}) {how}"
        return None

    return check


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _listen_loopback(port: int = 0) -> socket.socket:
    """A listening TCP socket on 127.0.0.1 for the rendezvous store (port 0: any free one,
    kept bound from now on, so no other process can take it before the store does)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)
    return sock


def _join_world(
    init_method: str,
    world_size: int,
    timeout_s: float,
    listener: socket.socket | None,
    joined: list,
) -> None:
    """Rank 0 joins the startup world (parallel.groups); its rendezvous store goes into
    `joined`. torch's TCPStore server listens on every interface; given a loopback listener,
    rank 0 hosts the store on that socket instead (the other ranks reach it at 127.0.0.1
    through `init_method` as usual)."""
    store = None
    if listener is not None:
        import torch.distributed as dist

        store = dist.TCPStore(
            "127.0.0.1",
            listener.getsockname()[1],
            world_size,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
        )
    joined.append(_pgroups().init_world(0, world_size, init_method, timeout_s, store))


def _init_world_watching(
    init_method: str,
    world_size: int,
    timeout_s: float,
    liveness,
    listener: socket.socket | None = None,
):
    """Join the startup world; with children of our own, fail fast if one dies first.
    Returns the rendezvous store (the workers' world meets there: keep it while serving)."""
    errors: list[BaseException] = []
    joined: list = []

    def join() -> None:
        try:
            _join_world(init_method, world_size, timeout_s, listener, joined)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
        reason = liveness() if liveness else None
        if reason and thread.is_alive():
            raise EngineDeadError(f"startup failed: {reason}")
    if errors:
        raise EngineDeadError(f"startup failed: {errors[0]}")
    return joined[0]


def control_bind() -> str:
    """Where rank 0's control sockets listen: loopback, unless TANDEM_CONTROL_HOST names the
    address (IP or host name) that workers on other nodes reach it at (multi-node)."""
    return f"tcp://{os.environ.get('TANDEM_CONTROL_HOST', '127.0.0.1')}"  # see runtime.control.auth


def start_cluster(config: TandemConfig, env: LaunchEnv, quiet: bool = False) -> Cluster:
    """Start (or join) every rank and wait until all have loaded, showing their progress on
    stderr (runtime.control.progress: bars on a terminal, plain lines when `quiet` or not)."""
    topology = config.topology()
    if env.world_size is not None:
        topology.check_world_size(env.world_size)
    display = StartupDisplay.for_stderr(rank_labels(topology), quiet)
    # the rendezvous store listens on loopback whenever the ranks meet at 127.0.0.1
    listener = None
    if env.init_method is None:  # spawn, mpi-spawn: rank 0 picks the port
        listener = _listen_loopback()
        init_method = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    else:
        init_method = env.init_method
        if env.method == "mpi" and init_method.startswith("tcp://127.0.0.1:"):
            listener = _listen_loopback(int(init_method.rsplit(":", 1)[1]))
    procs: list[subprocess.Popen] = []
    context = zmq.Context()
    rt = config.runtime
    try:
        if env.method == "spawn":
            _spawn_workers(topology, init_method, config, procs)
        elif env.method == "mpi-spawn":
            _mpi_spawn_workers(topology, init_method, config)
        elif env.method not in ("torchrun", "mpi"):
            raise LaunchError(f"rank 0 cannot start under launch method {env.method!r}")
        liveness = _procs_liveness(procs, topology) if procs else None
        store = _init_world_watching(
            init_method, topology.world_size, rt.startup_timeout_s, liveness, listener
        )
        # no key file: a random key for this launch, so that no other local process can
        # forge a worker's frames; the workers get it with the address
        key = None if auth.control_key() is not None else auth.launch_key()
        pool = WorkerPool(
            topology.worker_ranks,
            context,
            bind=control_bind(),
            heartbeat_s=rt.heartbeat_s,
            dead_after_s=max(10.0, 10 * rt.heartbeat_s),
            liveness=liveness,
            key=key,
        )
        log.info(
            "control plane at %s (%s)",
            pool.address,
            "key file" if key is None else "key of this launch",
        )
        _pgroups().broadcast_control(pool.address, key)
        _pgroups().end_startup_world()  # the workers build their groups among themselves
        pool.handshake(config.to_dict(), rt.startup_timeout_s)
        try:
            pool.await_ready(rt.startup_timeout_s, watch=display.observe)
        except EngineDeadError:
            usage = pool.usage_error()
            if usage is None:
                raise
            raise StartupUsageError(usage) from None
        finally:
            display.close()
        log.info("all %d workers ready (%s launch)", len(topology.worker_ranks), env.method)
    except BaseException:
        for proc in procs:
            proc.kill()
            proc.wait()
        context.destroy(linger=0)
        if listener is not None and listener.fileno() != -1:  # not handed to the store yet
            listener.close()
        raise
    return Cluster(config, topology, context, pool, store, procs)
