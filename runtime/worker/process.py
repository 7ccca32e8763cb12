"""The worker process: one device, the draft shard, the target shard or both.

Control arrives over ZeroMQ (msgpack, runtime.control.protocol); bulk tensors (draft tokens, the
accept verdict) move between the groups over torch.distributed on the worker's device.
"""

from __future__ import annotations

import dataclasses
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
from runtime.config import TandemConfig, load_config
from runtime.control import auth, protocol
from runtime.control.commands import (
    Command,
    CrossDraftCommand,
    CrossVerifyCommand,
    PrefillCommand,
    ReleaseCommand,
    Reply,
    RoundCommand,
    RoundReply,
    StepAck,
    StepCommand,
)
from runtime.control.heartbeat import Pulse
from runtime.control.progress import ProgressReporter
from runtime.control.protocol import (
    Done,
    Error,
    Heartbeat,
    Hello,
    Init,
    Message,
    ProtocolError,
    Ready,
    Shutdown,
)
from runtime.control.signals import SignalWakeup
from runtime.worker.cross import draft_cross, verify_cross
from runtime.worker.kv_pool import PoolTooSmallElsewhere
from runtime.worker.loading import load_shards
from runtime.worker.round import (
    NextWork,
    RoundParts,
    decode_target_only,
    drop_stale_ahead,
    prefill,
    speculate,
    speculate_overlapped,
    work_ahead,
)

log = logging.getLogger("tandem.worker")


class WorkerExit(Exception):
    """Leave the worker loop (orphaned, told to stop by a signal, or after reporting a
    problem of the config that rank 0 names to the user: `reported`)."""

    def __init__(self, message: str, code: int = 1, reported: bool = False):
        super().__init__(message)
        self.code = code
        self.reported = reported


SIGNAL_GRACE_S = 5.0  # after SIGINT/SIGTERM, wait this long for the orchestrator's shutdown
ERROR_GRACE_S = 3.0  # after reporting an error, as long (launcher.bootstrap.DEAD_GRACE_S)
EXIT_USAGE = 2  # the config asks for what this device cannot hold (the CLI's code)


class Worker:
    """A worker's end of the control plane, before init and after: its socket, the signals
    that stop it, the orchestrator's liveness (by its Pulse, from init on). `start` loads the
    shards and returns the serving loop (Serving), built whole."""

    def __init__(self, rank: int, world_size: int, sock: zmq.Socket, address: str, store):
        self.rank = rank
        self.world_size = world_size
        self.sock = sock
        self.address = address
        self.store = store  # the rendezvous store: the workers' world
        self.pulse: Pulse | None = None  # from init on
        self.signalled_at: float | None = None
        self.wakeup = SignalWakeup()  # entered by run_worker: a signal ends recv's wait
        self._poller: zmq.Poller | None = None

    def on_signal(self, signum, _frame) -> None:
        """SIGINT/SIGTERM (e.g. forwarded by torchrun or mpirun): the orchestrator gets it too
        and sends shutdown; exit cleanly on that, or on our own after a grace period. A
        normal way to stop (Ctrl-C reaches every process of the terminal's group): info."""
        log.info("rank %d: received signal %d", self.rank, signum)
        if self.signalled_at is None:
            self.signalled_at = time.monotonic()

    # --- control plane -------------------------------------------------------------------
    def send(self, msg: Message) -> None:
        self.sock.send(protocol.encode(msg, auth.control_key()))

    def recv(self, timeout_s: float) -> Message:
        """Next valid message from the orchestrator; WorkerExit when it has gone silent
        (before init: no message within timeout_s; after: no beacon beat for timeout_s)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.signalled_at is not None:
                # a live orchestrator got the signal too and sends shutdown at once; one
                # killed together with us (torchrun tearing the job down) never will
                if time.monotonic() - self.signalled_at > SIGNAL_GRACE_S:
                    raise WorkerExit("stopped by signal", code=0)
            if self.pulse is not None:
                if self.pulse.orchestrator_silent_s > timeout_s:
                    raise WorkerExit(f"orchestrator silent for {timeout_s:.0f} s; exiting")
            elif time.monotonic() > deadline:
                raise WorkerExit(f"no word from the orchestrator within {timeout_s:.0f} s")
            # block until a message or a signal comes or a check above could first turn true:
            # an idle worker's main thread wakes about once per silence limit, not each second
            if not self._wait(self._recv_wait_ms(deadline, timeout_s)):
                continue
            frame = self.sock.recv()
            try:
                return protocol.decode(frame, auth.control_key())
            except protocol.ProtocolError as exc:
                log.warning("rank %d: dropped control frame: %s", self.rank, exc)

    def _wait(self, timeout_ms: int) -> bool:
        """Whether a frame waits on the socket, after at most timeout_ms; a signal ends the
        wait early (self.wakeup, set by run_worker)."""
        if not self.wakeup.fds:
            return bool(self.sock.poll(timeout_ms))
        if self._poller is None:
            self._poller = zmq.Poller()
            self._poller.register(self.sock, zmq.POLLIN)
            for fd in self.wakeup.fds:
                self._poller.register(fd, zmq.POLLIN)
        ready = dict(self._poller.poll(timeout_ms))
        self.wakeup.drain()
        return self.sock in ready

    def _recv_wait_ms(self, deadline: float, timeout_s: float) -> int:
        """How long recv may block: until the earliest moment one of its checks could turn
        true (its deadline, the orchestrator's silence limit, after a signal the grace
        period), at least 10 ms. Without a signal wake-up pipe (not the main thread) at most
        a heartbeat period, so that a signal is seen that soon."""
        now = time.monotonic()
        period = self.pulse.period_s if self.pulse is not None else 1.0
        waits = [] if self.wakeup.fds else [period]
        if self.pulse is None:
            waits.append(deadline - now)
        else:
            waits.append(timeout_s - self.pulse.orchestrator_silent_s)
        if self.signalled_at is not None:
            waits.append(SIGNAL_GRACE_S - (now - self.signalled_at))
        return max(10, int(1000 * min(waits)) + 1)

    # --- startup -------------------------------------------------------------------------
    def start(self, startup_timeout_s: float) -> Serving:
        """Hello, init, the process groups and the shards; ready. Returns the serving loop."""
        self.send(Hello(self.rank, os.getpid(), socket.gethostname()))
        msg = self.recv(startup_timeout_s)
        if not isinstance(msg, Init):
            raise WorkerExit(f"expected init, got {msg.NAME}")
        config = load_config(msg.config, check_files=False, check_devices=False)
        self.pulse = Pulse(
            self.sock.context, self.rank, msg.pulse, msg.heartbeat, config.runtime.heartbeat_s
        )
        topology = config.topology()
        topology.check_world_size(self.world_size)
        spec = topology.worker(self.rank)
        groups = pgroups.build_groups(
            topology, self.rank, self.store, config.runtime.step_timeout_s
        )
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
        try:
            draft, target, kv_blocks = load_shards(
                config, spec, groups, device, self.rank, ProgressReporter(self.send, self.rank)
            )
        except PoolTooSmallElsewhere as exc:  # the worker whose budget it is says why
            self.await_shutdown(ERROR_GRACE_S)
            raise WorkerExit(f"rank {self.rank}: {exc}", EXIT_USAGE, reported=True) from None
        except MemoryError as exc:
            # a KV cache over its budget (runtime.models.runners.kv_budget): the config's problem,
            # which rank 0 names in one line (exit 2); a crash's traceback would say nothing
            self.send(Error(self.rank, -1, _usage_message(str(exc)), kind="usage"))
            self.await_shutdown(ERROR_GRACE_S)
            raise WorkerExit(f"rank {self.rank}: {exc}", EXIT_USAGE, reported=True) from None
        except Exception as exc:
            self.send(
                Error(
                    self.rank, -1, f"rank {self.rank} failed to load: {type(exc).__name__}: {exc}"
                )
            )
            raise
        parts = RoundParts(
            draft,
            target,
            groups.bridge,
            topology.draft_leader,
            topology.target_leader,
            self.rank,
            device,
            config.speculation.acceptance,
            profile=os.environ.get("TANDEM_PROFILE") == "1",
            overlap=config.overlapped,
        )
        self.send(
            Ready(
                self.rank,
                kv_blocks,
                all(s.tables is not None for s in (draft, target) if s is not None),
            )
        )
        return Serving(self, config, parts, self.pulse)

    def await_shutdown(self, timeout_s: float) -> None:
        """After reporting an error, wait (at most timeout_s, or until the orchestrator goes
        silent) for its shutdown, so that it can name the cause to the clients first: MPICH's
        hydra tears the whole job down as soon as a rank exits after another one died."""
        deadline = time.monotonic() + timeout_s
        while (
            time.monotonic() < deadline
            and self.pulse is not None
            and self.pulse.orchestrator_silent_s < 3 * self.pulse.period_s
        ):
            if self.sock.poll(100):
                try:
                    if isinstance(protocol.decode(self.sock.recv(), auth.control_key()), Shutdown):
                        return
                except ProtocolError:
                    pass

    def close(self) -> None:
        if self.pulse is not None:
            self.pulse.stop()


class Serving:
    """A started worker: the step commands from rank 0, each run on this rank's round parts
    (runtime.worker.round), until shutdown."""

    def __init__(self, worker: Worker, config: TandemConfig, parts: RoundParts, pulse: Pulse):
        self.worker = worker
        self.rank = worker.rank
        self.config = config
        self.parts = parts  # what a round touches on this rank
        self.pulse = pulse
        self.next_work: NextWork | None = None  # the announced next round, to start ahead

    # --- serving loop --------------------------------------------------------------------
    def serve(self) -> None:
        silent_s = max(10.0, 10 * self.config.runtime.heartbeat_s)
        while True:
            msg = self.worker.recv(silent_s)
            if isinstance(msg, Heartbeat):
                continue
            if isinstance(msg, Shutdown):
                return
            step = msg.step if isinstance(msg, StepCommand) else -1
            self.pulse.active_at = time.monotonic()  # beats at the working pace from its next
            try:
                result = self.handle(msg)
            except Exception as exc:
                # tell the orchestrator first and let it tell the clients before this rank
                # writes a word or exits: under mpirun either may end every rank at once
                self.worker.send(
                    Error(self.rank, step, f"rank {self.rank}: {type(exc).__name__}: {exc}")
                )
                self.worker.await_shutdown(ERROR_GRACE_S)
                log.error("rank %d step %d failed:\n%s", self.rank, step, traceback.format_exc())
                raise
            self.worker.send(Done(self.rank, step, result))
            self.work_ahead()

    def work_ahead(self) -> None:
        """Start the announced next round's first work (runtime.worker.round.work_ahead)."""
        nxt, self.next_work = self.next_work, None
        if nxt is not None:
            failure = work_ahead(self.parts, nxt)
            if failure is not None:
                log.warning(
                    "rank %d: work ahead failed: %s: %s", self.rank, type(failure).__name__, failure
                )

    def handle(self, msg: Message) -> Reply:
        """Dispatch one command: prefill, release, or a round (runtime.worker.round)."""
        if not isinstance(msg, Command):
            raise ProtocolError(f"not a step command: {msg.NAME!r}")
        cmd = msg
        drop_stale_ahead(self.parts, cmd.k if isinstance(cmd, RoundCommand) else None)
        shards = [s for s in (self.parts.draft, self.parts.target) if s is not None]
        max_k = self.config.speculation.max_draft_len
        if isinstance(cmd, CrossDraftCommand):
            if not 1 <= cmd.k <= max_k:
                raise ValueError(f"draft_cross.k must be in 1..{max_k}, got {cmd.k}")
            return draft_cross(self.parts, cmd)
        if isinstance(cmd, CrossVerifyCommand):
            if any(len(p) > max_k for p in cmd.proposals):
                raise ValueError(f"verify_cross: more than {max_k} proposals for a slot")
            return self._with_cached(verify_cross(self.parts, cmd), cmd.slots, shards)
        if isinstance(cmd, ReleaseCommand):
            for shard in shards:
                shard.release(cmd.slots)
            return StepAck()
        if isinstance(cmd, PrefillCommand):
            result = prefill(
                self.parts, cmd.slots, cmd.prompts, cmd.params, cmd.cached, cmd.tables, cmd.final
            )
            return self._with_cached(result, cmd.slots, shards)
        self._check_round(cmd)
        for shard in shards:
            shard.grow(cmd.slots, cmd.tables)
        if cmd.k == 0:
            result = decode_target_only(self.parts, cmd.slots, cmd.steps)
        elif self.parts.overlap:
            result = speculate_overlapped(self.parts, cmd.slots, cmd.k, cmd.next_k)
        else:
            result = speculate(self.parts, cmd.slots, cmd.k)
        if self.config.runtime.draft_ahead:  # started by work_ahead once result is sent
            self.next_work = NextWork(cmd.slots, cmd.next_k)
        return self._with_cached(result, cmd.slots, shards)

    @staticmethod
    def _with_cached(result: RoundReply, slots: list[int], shards: list) -> RoundReply:
        """The reply with, per slot, the positions every shard of this rank caches (a draft
        with another tokenizer counts its own positions, in its own tables: not reported)."""
        shards = [s for s in shards if not getattr(s, "cross", False)]
        if not shards:
            return result
        cached = [min(column) for column in zip(*(s.cached(slots) for s in shards))]
        return dataclasses.replace(result, cached=cached)

    def _check_round(self, cmd: RoundCommand) -> None:
        """Every number of a round command in its range."""
        max_k, max_len = self.config.speculation.max_draft_len, self.config.runtime.max_seq_len
        if not 0 <= cmd.k <= max_k:
            raise ValueError(f"round.k must be in 0..{max_k}, got {cmd.k}")
        if not 0 <= cmd.next_k <= max_k:
            raise ValueError(f"round.next_k must be in 0..{max_k}, got {cmd.next_k}")
        if cmd.k == 0 and not 1 <= cmd.steps <= max_len:
            raise ValueError(
                f"round.steps of a target-only round must be in 1..{max_len}, got {cmd.steps}"
            )


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
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"w{rank}".encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1000)
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.connect(address)
    worker = Worker(rank, world_size, sock, address, store)
    worker.signalled_at = early[0] if early else None
    signal.signal(signal.SIGTERM, worker.on_signal)
    signal.signal(signal.SIGINT, worker.on_signal)
    code = 0
    try:
        with worker.wakeup:
            worker.start(startup_timeout_s).serve()
    except WorkerExit as exc:
        # stopped as asked, or rank 0 tells the user why: only a surprise is a warning
        log.log(
            logging.INFO if exc.code == 0 or exc.reported else logging.WARNING,
            "rank %d: %s",
            rank,
            exc,
        )
        code = exc.code
    except Exception:  # noqa: BLE001 - a crash: its traceback logged, exit 1
        log.error("rank %d crashed:\n%s", rank, traceback.format_exc())
        code = 1
    finally:
        worker.close()
        # after a failure, give the error message (already queued) a moment to leave
        sock.close(linger=0 if code == 0 else 1000)
        context.term()
        if code == 0:
            pgroups.destroy()
    if "mpi4py.MPI" not in sys.modules:
        # All is closed: skip the interpreter's teardown (seconds spent freeing torch's
        # modules on a busy host), which every orchestrator shutdown would wait for. An MPI
        # rank takes the normal way out: MPI must be finalized.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
