"""The worker process: one device, the draft shard, the target shard or both.

Control arrives over ZeroMQ (msgpack, runtime.protocol); bulk tensors (draft tokens, the
accept verdict) move between the groups over torch.distributed on the worker's device.
"""
from __future__ import annotations

import copy
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
from parallel.topology import Topology, WorkerSpec, topology_from_config
from parallel.transfer import bridge_broadcast
from runtime import auth, protocol
from runtime.config import TandemConfig, load_config
from runtime.heartbeat import Pulse
from runtime.shards import DraftShard, TargetShard
from runtime.stepclock import StepClock

log = logging.getLogger("tandem.worker")


class WorkerExit(Exception):
    """Leave the worker loop (orphaned, or told to stop by a signal)."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


SIGNAL_GRACE_S = 5.0   # after SIGINT/SIGTERM, wait this long for the orchestrator's shutdown
DECODE_AHEAD_STEPS = 1  # target-only steps queued ahead: one outlasts a control round trip
ERROR_GRACE_S = 3.0    # after reporting an error, as long (launcher.bootstrap.DEAD_GRACE_S)


class Worker:
    def __init__(self, rank: int, world_size: int, sock: zmq.Socket, address: str):
        self.rank = rank
        self.world_size = world_size
        self.sock = sock
        self.address = address
        self.config: TandemConfig | None = None
        self.topology: Topology | None = None
        self.spec: WorkerSpec | None = None
        self.groups: pgroups.Groups | None = None
        self.draft: DraftShard | None = None
        self.target: TargetShard | None = None
        self.ahead_args: tuple[list[int], int] | None = None   # next round to draft ahead
        self.decode_ahead_slots: list[int] | None = None      # target-only round to start
        self.device = torch.device("cpu")
        self.pulse: Pulse | None = None
        self.profile = os.environ.get("TANDEM_PROFILE") == "1"
        self.signalled_at: float | None = None

    def on_signal(self, signum, _frame) -> None:
        """SIGINT/SIGTERM (e.g. forwarded by torchrun or mpirun): the orchestrator gets it too
        and sends shutdown; exit cleanly on that, or on our own after a grace period."""
        log.warning("rank %d: received signal %d", self.rank, signum)
        if self.signalled_at is None:
            self.signalled_at = time.monotonic()

    # --- control plane -------------------------------------------------------------------
    def send(self, msg: dict) -> None:
        self.sock.send(protocol.encode(msg, auth.control_key()))

    def recv(self, timeout_s: float) -> dict:
        """Next valid message from the orchestrator; WorkerExit when it has gone silent
        (before init: no message within timeout_s; after: no beacon beat for timeout_s)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.signalled_at is not None:
                # no shutdown will come from an orchestrator that stopped beating (killed
                # together with us, e.g. torchrun tearing the job down after rank 0 died)
                orphaned = self.pulse is not None and \
                    self.pulse.orchestrator_silent_s > 3 * self.pulse.period_s
                if orphaned or time.monotonic() - self.signalled_at > SIGNAL_GRACE_S:
                    raise WorkerExit("stopped by signal", code=0)
            if self.pulse is not None:
                if self.pulse.orchestrator_silent_s > timeout_s:
                    raise WorkerExit(f"orchestrator silent for {timeout_s:.0f} s; exiting")
            elif time.monotonic() > deadline:
                raise WorkerExit(f"no word from the orchestrator within {timeout_s:.0f} s")
            if not self.sock.poll(200):
                continue
            frame = self.sock.recv()
            try:
                return protocol.decode(frame, auth.control_key())
            except protocol.ProtocolError as exc:
                log.warning("rank %d: dropped control frame: %s", self.rank, exc)

    # --- startup -------------------------------------------------------------------------
    def start(self, startup_timeout_s: float) -> None:
        self.send({"type": "hello", "rank": self.rank, "pid": os.getpid(),
                   "host": socket.gethostname()})
        msg = self.recv(startup_timeout_s)
        if msg["type"] != "init":
            raise WorkerExit(f"expected init, got {msg['type']}")
        self.config = load_config(msg["config"], check_files=False, check_devices=False)
        self.pulse = Pulse(self.sock.context, self.rank, self.address, msg["heartbeat"],
                           self.config.runtime.heartbeat_s)
        self.topology = topology_from_config(self.config)
        self.topology.check_world_size(self.world_size)
        self.spec = self.topology.worker(self.rank)
        self.groups = pgroups.build_groups(self.topology, self.config.runtime.step_timeout_s)
        self.device = self.spec.device.torch_device
        if self.device.type == "cuda":
            # multi-node: config ids are global, each node numbers its own GPUs from 0
            self.device = torch.device("cuda", self.device.index % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
            # cuDNN attention builds a new plan for every new KV length (tens of ms each);
            # the KV length changes every round, so use the flash / memory-efficient kernels
            torch.backends.cuda.enable_cudnn_sdp(False)
        else:  # CPU workers share the host's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // len(self.topology.workers)))
        try:
            self._load_shards()
        except Exception as exc:
            self.send({"type": "error", "rank": self.rank, "step": -1,
                       "message": f"rank {self.rank} failed to load: {type(exc).__name__}: {exc}"})
            raise
        self.send({"type": "ready", "rank": self.rank})

    def _load_shards(self) -> None:
        from parallel.tensor_parallel import TPInfo
        from parallel.vocab import VocabParallel
        from runtime.models import load_model

        spec = self.spec
        draft_cfg, target_cfg = self.config.draft, self.config.target
        draft_model = target_model = None
        if spec.hosts_target:
            tp = TPInfo(self.groups.target_tp, spec.target_tp_rank, target_cfg.tp_size)
            target_model = load_model(target_cfg.model, target_cfg.torch_dtype, self.device, tp,
                                      gather_logits=not tp.enabled)
        if spec.hosts_draft:
            same = (draft_cfg.model, draft_cfg.dtype, draft_cfg.devices) == \
                (target_cfg.model, target_cfg.dtype, target_cfg.devices)
            if same and target_model is not None and draft_cfg.tp_size == 1:
                draft_model = copy.deepcopy(target_model)  # load once; own KV cache
            else:
                tp = TPInfo(self.groups.draft_tp, spec.draft_tp_rank, draft_cfg.tp_size)
                draft_model = load_model(draft_cfg.model, draft_cfg.torch_dtype, self.device, tp)
            # decode steps: the pending token(s) (1 or 2), then one token at a time
            self.draft = self._shard(DraftShard, "draft", draft_model, step_lens=[1, 2])
        if target_model is not None:
            spec_cfg = self.config.speculation   # verify steps: pending + k draft tokens
            ks = [spec_cfg.draft_len] if spec_cfg.fixed_draft_len else \
                list(range(1, spec_cfg.max_draft_len + 1))
            self.target = self._shard(TargetShard, "target", target_model,
                                      step_lens=[k + 1 for k in ks])
            if target_cfg.tp_size > 1:  # verify without gathering the vocabulary if greedy
                self.target.vocab_parallel = VocabParallel.of(target_model,
                                                              self.groups.target_tp)

    def _shard(self, cls, key: str, model, step_lens: list[int]):
        """A shard with its KV cache preallocated within the model's memory budget; steps of
        these lengths run as CUDA graphs, all captured now (a tensor-parallel shard's graphs
        hold its NCCL all-reduces; every rank of the group captures the same shapes in the
        same order)."""
        from runtime.models.kv_budget import check_kv_budget

        rt, model_cfg = self.config.runtime, getattr(self.config, key)
        cache_len = rt.max_seq_len + self.config.speculation.max_draft_len + 2
        check_kv_budget(key, model, rt.max_batch_size, cache_len, model_cfg.kv_cache_memory,
                        self.device)
        shard = cls(model, self.device, rt.max_batch_size, cache_len,
                    self.config.speculation.acceptance, max(step_lens), rt.cuda_graphs)
        start = time.perf_counter()
        count = shard.runner.capture_all(step_lens)
        if count:
            log.info("rank %d: %s: %d CUDA graphs captured in %.1f s", self.rank, key, count,
                     time.perf_counter() - start)
        return shard

    # --- serving loop --------------------------------------------------------------------
    def serve(self) -> None:
        silent_s = max(10.0, 10 * self.config.runtime.heartbeat_s)
        while True:
            msg = self.recv(silent_s)
            kind = msg["type"]
            if kind == "heartbeat":
                continue
            if kind == "shutdown":
                return
            step = msg.get("step", -1)
            try:
                result = self.handle(msg)
            except Exception as exc:
                # tell the orchestrator first and let it tell the clients before this rank
                # writes a word or exits: under mpirun either may end every rank at once
                self.send({"type": "error", "rank": self.rank, "step": step,
                           "message": f"rank {self.rank}: {type(exc).__name__}: {exc}"})
                self.await_shutdown(ERROR_GRACE_S)
                log.error("rank %d step %d failed:\n%s", self.rank, step, traceback.format_exc())
                raise
            self.send({"type": "done", "rank": self.rank, "step": step, "result": result})
            self.work_ahead()

    def work_ahead(self) -> None:
        """After a round's result is sent: queue the next round's first work on the GPU, so
        it runs while the orchestrator decides and its next command travels
        (runtime.shards): the draft's proposals when the next round drafts (the command's
        next_k), else the target's first DECODE_AHEAD_STEPS of a target-only round."""
        jobs = []
        if self.ahead_args is not None:
            jobs.append((self.draft, "propose_ahead", self.ahead_args))
        if self.decode_ahead_slots is not None:
            jobs.append((self.target, "decode_ahead",
                         (self.decode_ahead_slots, DECODE_AHEAD_STEPS)))
        self.ahead_args = self.decode_ahead_slots = None
        for shard, work, args in jobs:
            try:
                getattr(shard, work)(*args)
            except Exception:  # noqa: BLE001 - the next round works on command and reports
                log.warning("rank %d: %s failed:\n%s", self.rank, work, traceback.format_exc())
                shard.drop_ahead()

    def await_shutdown(self, timeout_s: float) -> None:
        """After reporting an error, wait (at most timeout_s, or until the orchestrator goes
        silent) for its shutdown, so that it can name the cause to the clients first: MPICH's
        hydra tears the whole job down as soon as a rank exits after another one died."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.pulse is not None and \
                self.pulse.orchestrator_silent_s < 3 * self.pulse.period_s:
            if self.sock.poll(100):
                try:
                    if protocol.decode(self.sock.recv(), auth.control_key())["type"] == \
                            "shutdown":
                        return
                except protocol.ProtocolError:
                    pass

    def handle(self, msg: dict) -> dict:
        kind = msg["type"]
        slots = protocol.int_list(msg["slots"], f"{kind}.slots")
        k = msg["k"] if kind == "round" else None
        # work done ahead is kept only by the round it was done for (both check the slots)
        for shard, keep in ((self.draft, k is not None and k > 0), (self.target, k == 0)):
            if shard is not None and not keep:
                shard.drop_ahead()
        if kind == "prefill":
            prompts = [protocol.int_list(p, "prefill.prompts") for p in msg["prompts"]]
            params = [protocol.check_sampling(p) for p in msg["params"]]
            if not len(prompts) == len(params) == len(slots):
                raise protocol.ProtocolError("prefill: slots, prompts, params differ in length")
        if kind in ("prefill", "release"):
            for shard in (self.draft, self.target):
                if shard is not None and kind == "prefill":
                    shard.prefill(slots, prompts, params)
                elif shard is not None:
                    shard.release(slots)
            return {}
        if kind != "round":
            raise protocol.ProtocolError(f"worker cannot handle {kind!r}")
        next_k = msg.get("next_k", k)
        if not 0 <= next_k <= self.config.speculation.max_draft_len:
            raise ValueError(f"round.next_k must be in 0..{self.config.speculation.max_draft_len}"
                             f", got {next_k}")
        result = self.decode_target_only(slots, msg.get("steps", 1)) if k == 0 else \
            self.speculate(slots, k)
        if self.config.runtime.draft_ahead:   # started by work_ahead once result is sent
            if next_k > 0 and self.draft is not None:
                self.ahead_args = (slots, next_k)
            if next_k == 0 and self.target is not None:
                self.decode_ahead_slots = slots
        return result

    def decode_target_only(self, slots: list[int], steps: int) -> dict:
        """A round without a draft (draft_len auto, k = 0): the target decodes `steps` tokens
        per slot, exactly those a round that rejected every draft would take, then they move
        to the draft, which feeds them to its cache with its next proposal."""
        if not 1 <= steps <= self.config.runtime.max_seq_len:
            raise ValueError(f"round.steps of a target-only round must be in "
                             f"1..{self.config.runtime.max_seq_len}, got {steps}")
        start = time.perf_counter()
        clock = StepClock(self.device, enabled=self.profile)
        tokens = torch.zeros(len(slots), steps, dtype=torch.long, device=self.device)
        if self.target is not None:
            tokens = self.target.decode(slots, steps)                     # [B, steps]
        clock.lap("decode_s")
        bridge_broadcast(tokens, self.topology.target_leader, self.groups.bridge)
        rows = tokens.tolist()                                            # the one sync
        clock.lap("tokens_transfer_s")
        for shard in (self.draft, self.target):
            if shard is not None:
                shard.append_decoded(slots, rows)
        result = {"timing": clock.laps} if self.profile else {}
        result["worker_s"] = time.perf_counter() - start
        if self.rank == self.topology.target_leader:
            result["tokens"], result["accepted"] = rows, [0] * len(slots)
        return result

    def speculate(self, slots: list[int], k: int) -> dict:
        """One round: draft k tokens, move them (and q for `logits` acceptance) to the target,
        verify, move the verdict back, roll both caches to the accepted length."""
        if not 1 <= k <= self.config.speculation.max_draft_len:
            raise ValueError(f"round.k must be in 1..{self.config.speculation.max_draft_len}, "
                             f"got {k}")
        start = time.perf_counter()
        shard = self.target or self.draft
        batch, dev = len(slots), self.device
        need_q = self.config.speculation.acceptance == "logits" and \
            not shard.sampling(slots).greedy
        clock = StepClock(dev, enabled=self.profile)
        draft_tokens = torch.zeros(batch, k, dtype=torch.long, device=dev)
        draft_probs = None
        if self.draft is not None:
            ahead = self.draft.take_ahead(slots, k)
            draft_tokens, draft_probs = ahead or self.draft.propose(slots, k)  # [B, k], [B, k, V]
        clock.lap("draft_s")
        bridge_broadcast(draft_tokens, self.topology.draft_leader, self.groups.bridge)
        clock.lap("draft_tokens_transfer_s")
        if need_q:
            if draft_probs is None:
                draft_probs = torch.zeros(batch, k, shard.model.vocab_size, device=dev)
            bridge_broadcast(draft_probs, self.topology.draft_leader, self.groups.bridge)
        clock.lap("draft_probs_transfer_s")
        verdict = torch.zeros(batch, 2, dtype=torch.long, device=dev)
        if self.target is not None:
            accepted, next_token = self.target.verify(slots, draft_tokens,
                                                      draft_probs if need_q else None)
            verdict = torch.stack([accepted, next_token], dim=1)           # [B, 2]
        clock.lap("verify_s")
        bridge_broadcast(verdict, self.topology.target_leader, self.groups.bridge)
        clock.lap("verdict_transfer_s")
        rows = torch.cat([draft_tokens, verdict], dim=1).tolist()         # the round's one sync
        drafts = [row[:k] for row in rows]
        accepted, next_tokens = [row[k] for row in rows], [row[k + 1] for row in rows]
        if self.draft is not None:
            self.draft.commit(slots, drafts, accepted, next_tokens)
        if self.target is not None:
            self.target.commit(slots, accepted, next_tokens)
        result = {"timing": clock.laps} if self.profile else {}
        result["worker_s"] = time.perf_counter() - start
        if self.rank == self.topology.target_leader:
            result["tokens"] = [d[:a] + [n] for d, a, n in zip(drafts, accepted, next_tokens)]
            result["accepted"] = accepted
        return result

    def close(self) -> None:
        if self.pulse is not None:
            self.pulse.stop()


def run_worker(rank: int, world_size: int, init_method: str, startup_timeout_s: float) -> int:
    """Entry of every worker rank, whatever launched it. Returns the exit code."""
    logging.basicConfig(level=os.environ.get("TANDEM_LOG", "WARNING"),
                        format=f"[tandem rank {rank}] %(levelname)s %(message)s")
    pgroups.init_world(rank, world_size, init_method, startup_timeout_s)
    address, key = pgroups.broadcast_control(None)
    if key is not None:             # rank 0's key for this launch (no key file configured)
        auth.use_control_key(key)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"w{rank}".encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1000)
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.connect(address)
    worker = Worker(rank, world_size, sock, address)
    signal.signal(signal.SIGTERM, worker.on_signal)
    signal.signal(signal.SIGINT, worker.on_signal)
    code = 0
    try:
        worker.start(startup_timeout_s)
        worker.serve()
    except WorkerExit as exc:
        log.warning("rank %d: %s", rank, exc)
        code = exc.code
    except Exception:
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
