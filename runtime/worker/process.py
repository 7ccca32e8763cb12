"""The worker process: one device, the draft shard, the target shard or both.

Control arrives over ZeroMQ (msgpack, runtime.control.protocol; the worker's end:
runtime.worker.control_link); bulk tensors (draft tokens, the accept verdict) move between
the groups over torch.distributed on the worker's device. This module is the process's life:
its entry (run_worker), the startup handshake (hello, init, the process groups, the device,
the shards, ready: start) and its exit; in between it serves the step commands
(runtime.worker.dispatch).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
import traceback

import torch
import zmq

from parallel import groups as pgroups
from parallel.groups import Groups
from parallel.topology import Topology, WorkerSpec
from runtime.config import TandemConfig, load_config
from runtime.control import auth
from runtime.control.heartbeat import Pulse
from runtime.control.progress import ProgressReporter
from runtime.control.protocol import Error, Hello, Init, Ready
from runtime.worker.control_link import ERROR_GRACE_S, SIGNAL_GRACE_S, ControlLink, WorkerExit
from runtime.worker.dispatch import Serving
from runtime.worker.draft_shard import DraftShard
from runtime.worker.kv_pool import PoolTooSmallElsewhere
from runtime.worker.loading import load_shards
from runtime.worker.round import RoundParts
from runtime.worker.target_shard import TargetShard

log = logging.getLogger("tandem.worker")

EXIT_USAGE = 2  # the config asks for what this device cannot hold (the CLI's code)


def start(link: ControlLink, world_size: int, store, startup_timeout_s: float) -> Serving:
    """Hello, init, the process groups and the shards; ready. Returns the serving loop.
    store: the rendezvous store, the workers' world."""
    rank = link.rank
    link.send(Hello(rank, os.getpid(), socket.gethostname()))
    msg = link.recv(startup_timeout_s)
    if not isinstance(msg, Init):
        raise WorkerExit(f"expected init, got {msg.NAME}")
    config = load_config(msg.config, check_files=False, check_devices=False)
    pulse = Pulse(link.sock.context, rank, msg.pulse, msg.heartbeat, config.runtime.heartbeat_s)
    link.pulse = pulse
    link.grace_s = SIGNAL_GRACE_S + config.server.shutdown_timeout_s
    topology = config.topology()
    topology.check_world_size(world_size)
    spec = topology.worker(rank)
    groups = pgroups.build_groups(topology, rank, store, config.runtime.step_timeout_s)
    device = _use_device(spec, topology, config)
    draft, target, kv_blocks = _load(link, config, spec, groups, device)
    parts = RoundParts(
        draft,
        target,
        groups.bridge,
        topology.draft_leader,
        topology.target_leader,
        rank,
        device,
        config.speculation.acceptance,
        profile=os.environ.get("TANDEM_PROFILE") == "1",
        overlap=config.overlapped,
    )
    shares_blocks = all(s.tables is not None for s in (draft, target) if s is not None)
    link.send(Ready(rank, kv_blocks, shares_blocks))
    return Serving(link, config, parts, pulse)


def _use_device(spec: WorkerSpec, topology: Topology, config: TandemConfig) -> torch.device:
    """This worker's device, made the current one: a CUDA device, or the CPU with this
    worker's share of the host's cores."""
    device = spec.device.torch_device
    if device.type == "cuda":
        if spec.device.node is None:
            # ids without a node (unlike n1:0) are global; each node counts from 0
            device = torch.device("cuda", device.index % torch.cuda.device_count())
        torch.cuda.set_device(device)
        # cuDNN attention builds a new plan for every new KV length (tens of ms each);
        # the KV length changes every round, so use the flash / memory-efficient kernels
        torch.backends.cuda.enable_cudnn_sdp(False)
    else:  # CPU workers share the host's cores (each pinned to its block when asked)
        _bind_cpu_block(topology.workers.index(spec), len(topology.workers))
        torch.set_num_threads(_cpu_threads(config.runtime.cpu_threads))
    return device


def _load(
    link: ControlLink, config: TandemConfig, spec: WorkerSpec, groups: Groups, device: torch.device
) -> tuple[DraftShard | None, TargetShard | None, int]:
    """The shards (runtime.worker.loading.load_shards): (draft, target, kv_blocks). A failure
    is reported to rank 0 first; one of the config's (a KV pool over its budget) is a
    WorkerExit with EXIT_USAGE."""
    rank = link.rank
    try:
        return load_shards(config, spec, groups, device, rank, ProgressReporter(link.send, rank))
    except PoolTooSmallElsewhere as exc:  # the worker whose budget it is says why
        link.await_shutdown(ERROR_GRACE_S)
        raise WorkerExit(f"rank {rank}: {exc}", EXIT_USAGE, reported=True) from None
    except MemoryError as exc:
        # a KV cache over its budget (runtime.models.runners.kv_budget): the config's problem,
        # which rank 0 names in one line (exit 2); a crash's traceback would say nothing
        link.send(Error(rank, -1, _usage_message(str(exc)), kind="usage"))
        link.await_shutdown(ERROR_GRACE_S)
        raise WorkerExit(f"rank {rank}: {exc}", EXIT_USAGE, reported=True) from None
    except Exception as exc:
        link.send(Error(rank, -1, f"rank {rank} failed to load: {type(exc).__name__}: {exc}"))
        raise


# runtime.cpu_threads: null. Measured with the demo on 2 cores (docs/configuration.md, "CPU
# threads"): one thread is as fast alone as two (the worker's share of the cores), and beside
# a busy neighbour it waits on no teammate; more threads pay for batched work of larger models
AUTO_CPU_THREADS = 1


def _cpu_threads(configured: int | None) -> int:
    """A CPU worker's intra-op threads: runtime.cpu_threads, else AUTO_CPU_THREADS."""
    return AUTO_CPU_THREADS if configured is None else configured


def _bind_cpu_block(position: int, workers: int) -> int:
    """This CPU worker's share of the cores this process may use (worker `position` of
    `workers`, equal blocks), at least 1. With TANDEM_CPU_AFFINITY=1 it is also pinned to its
    block (it and the threads it starts from now on), so that draft and target each keep a
    core and its caches. Off by default: on a host shared with other busy processes a pinned
    worker cannot leave a core they crowd (measured in docs/configuration.md, "Overlapped
    speculation"). With fewer cores than workers (or a worker past this host's cores, as on
    several nodes) nothing is pinned."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    per = len(allowed) // workers if allowed else (os.cpu_count() or 1) // workers
    if per < 1:
        return 1
    block = allowed[position * per : (position + 1) * per]
    if block and os.environ.get("TANDEM_CPU_AFFINITY") == "1":
        os.sched_setaffinity(0, block)
    return per


def _usage_message(text: str) -> str:
    """'target KV cache needs ...' -> 'target: KV cache needs ...' (the model's key first,
    like a config error)."""
    name, _, rest = text.partition(" ")
    return f"{name}: {rest}" if name in ("draft", "target") and rest else text


def run_worker(rank: int, world_size: int, init_method: str, startup_timeout_s: float) -> int:
    """Entry of every worker rank, whatever launched it. Returns the exit code."""
    logging.basicConfig(
        level=os.environ.get("TANDEM_LOG", "WARNING"),
        format=f"[tandem rank {rank}] %(levelname)s %(message)s",
    )
    early: list[float] = []  # a signal while joining the world: no traceback, noted below

    def on_early_signal(signum, _frame) -> None:
        log.info("rank %d: received signal %d while starting", rank, signum)
        early.append(time.monotonic())

    signal.signal(signal.SIGTERM, on_early_signal)
    signal.signal(signal.SIGINT, on_early_signal)
    store = pgroups.init_world(rank, world_size, init_method, startup_timeout_s)
    address, key = pgroups.broadcast_control(None)
    pgroups.end_startup_world()
    if key is not None:  # rank 0's key for this launch (no key file configured)
        auth.use_control_key(key)
    context = zmq.Context()
    sock = _control_socket(context, rank, address)
    link = ControlLink(rank, sock)
    link.signalled_at = early[0] if early else None
    signal.signal(signal.SIGTERM, link.on_signal)
    signal.signal(signal.SIGINT, link.on_signal)
    code = _serve(link, context, world_size, store, startup_timeout_s)
    if "mpi4py.MPI" not in sys.modules:
        # All is closed: skip the interpreter's teardown (seconds spent freeing torch's
        # modules on a busy host), which every orchestrator shutdown would wait for. An MPI
        # rank takes the normal way out: MPI must be finalized.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _control_socket(context: zmq.Context, rank: int, address: str) -> zmq.Socket:
    """This rank's DEALER socket, connected to the orchestrator's control address."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"w{rank}".encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1000)
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.connect(address)
    return sock


def _serve(
    link: ControlLink, context: zmq.Context, world_size: int, store, startup_timeout_s: float
) -> int:
    """Start, serve until shutdown, close the socket, the context and (after a clean end)
    the process groups. Returns the exit code."""
    code = 0
    try:
        with link.wakeup:
            start(link, world_size, store, startup_timeout_s).serve()
    except WorkerExit as exc:
        # stopped as asked, or rank 0 tells the user why: only a surprise is a warning
        log.log(
            logging.INFO if exc.code == 0 or exc.reported else logging.WARNING,
            "rank %d: %s",
            link.rank,
            exc,
        )
        code = exc.code
    except Exception:  # noqa: BLE001 - a crash: its traceback logged, exit 1
        log.error("rank %d crashed:\n%s", link.rank, traceback.format_exc())
        code = 1
    finally:
        link.close()
        # after a failure, give the error message (already queued) a moment to leave
        link.sock.close(linger=0 if code == 0 else 1000)
        context.term()
        if code == 0:
            pgroups.destroy()
    return code
