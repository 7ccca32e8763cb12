"""The bench's target phase: the `target` mode and the target's step costs (behind c).

`measure` loads the target through tandem's model code and the workers' StepRunner, runs the
`target` mode for every batch size and times one decode and one verify step per k. At target
TP 1 it runs in the bench's own process. At TP > 1, `run_tensor_parallel` starts one process
per rank (spawn; NCCL on CUDA, gloo on CPU), each runs `measure` on its shard, rank 0 sends
the report back as JSON; a rank that dies or a phase that overruns `timeout_s` ends it with an
error, and no rank is left running.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any

import torch

from runtime.bench import metrics
from runtime.bench.modes import timed
from runtime.bench.tandem_modes import TandemTarget, worker_backends


@dataclass
class TargetJob:
    path: str
    dtype: str
    devices: list[str]  # one per TP rank
    max_batch: int
    cache_len: int
    max_step_len: int
    cuda_graphs: bool
    prompts: list[list[int]]
    batch_sizes: list[int]
    new_tokens: int
    warmup: int
    repeats: int
    run_target: bool  # the `target` mode (else only the step costs)
    verify_ks: list[int]  # verify steps to time (k + 1 tokens); empty: no step costs
    position: int  # cache position of the timed steps
    timeout_s: float = 3600.0
    quantization: str | None = None  # the target's (fp8: quantized on load)
    cpu_threads: int | None = None  # CPU step costs: the threads an engine worker gets


def _step_costs(holder: TandemTarget, device: torch.device, job: TargetJob) -> dict:
    with metrics.cpu_threads(device, job.cpu_threads):
        return _timed_steps(holder, device, job)


def _timed_steps(holder: TandemTarget, device: torch.device, job: TargetJob) -> dict:
    costs = {}
    for bsz in job.batch_sizes:
        costs[str(bsz)] = {
            "target_decode_step_s": metrics.step_time(holder.runner, device, bsz, 1, job.position),
            "target_verify_step_s": {
                str(k): metrics.step_time(holder.runner, device, bsz, k + 1, job.position)
                for k in job.verify_ks
            },
        }
    return costs


def measure(job: TargetJob, tp=None) -> dict:
    """{"weight_bytes", "kv_position_bytes": this rank's, "target": {batch: Outcome fields or error
    text},
    "steps": {batch: step costs} or error text}; batch keys are strings (JSON)."""
    rank = 0 if tp is None else tp.rank
    device = torch.device(job.devices[rank])
    parallel = tp is not None and tp.enabled
    holder = TandemTarget(
        job.path,
        getattr(torch, job.dtype),
        device,
        job.max_batch,
        job.cache_len,
        job.max_step_len,
        job.cuda_graphs,
        tp,
        quantization=job.quantization,
    )
    try:
        report: dict[str, Any] = {
            "weight_bytes": metrics.weight_bytes_per_step(holder.model),
            "kv_position_bytes": metrics.kv_bytes_per_position(holder.model),
            "target": {},
            "steps": {},
        }
        for bsz in job.batch_sizes if job.run_target else ():
            report["target"][str(bsz)] = _reported(
                parallel,
                lambda bsz=bsz: asdict(
                    timed(holder, job.prompts[:bsz], job.new_tokens, job.warmup, job.repeats)
                ),
            )
        if job.verify_ks:
            report["steps"] = _reported(parallel, lambda: _step_costs(holder, device, job))
        return report
    finally:
        holder.close()


def _reported(parallel: bool, measurement):
    """measurement()'s result, or its error as text for the table. Under TP the error is
    raised instead: the other ranks cannot go on alone."""
    try:
        return measurement()
    except Exception as exc:
        if parallel:
            raise
        traceback.print_exc()
        return f"{type(exc).__name__}: {exc}"


def _rank_main(rank: int, job_json: str, init_file: str, conn) -> None:
    import torch.distributed as dist

    from parallel.groups import TPInfo

    job = TargetJob(**json.loads(job_json))
    size, device = len(job.devices), torch.device(job.devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=job.timeout_s),
    )
    try:
        with worker_backends(), torch.no_grad():
            report = measure(job, TPInfo(dist.group.WORLD, rank, size))
        if rank == 0:
            conn.send_bytes(json.dumps(report).encode())
    finally:
        dist.destroy_process_group()


def run_tensor_parallel(job: TargetJob) -> dict:
    """`measure` on len(job.devices) TP ranks in their own processes; rank 0's report."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    fd, init_file = tempfile.mkstemp(prefix="tandem-bench-tp-")
    os.close(fd)
    os.unlink(init_file)  # the file store creates it
    receiver, sender = ctx.Pipe(duplex=False)
    payload = json.dumps(asdict(job))
    procs = [
        ctx.Process(target=_rank_main, args=(r, payload, init_file, sender))
        for r in range(len(job.devices))
    ]
    for p in procs:
        p.start()
    try:
        return _await_report(receiver, procs, time.monotonic() + job.timeout_s)
    finally:
        for p in procs:
            p.join(timeout=30 if p.is_alive() else 0)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        if os.path.exists(init_file):
            os.unlink(init_file)


def _await_report(receiver, procs, deadline: float) -> dict:
    while True:
        if receiver.poll(1.0):
            return json.loads(receiver.recv_bytes())
        failed = [
            (r, p.exitcode)
            for r, p in enumerate(procs)
            if p.exitcode is not None and p.exitcode != 0
        ]
        if failed:
            rank, code = failed[0]
            raise RuntimeError(
                f"tensor-parallel target rank {rank} exited with status {code} "
                f"(its traceback is above)"
            )
        if all(p.exitcode == 0 for p in procs):
            raise RuntimeError("the tensor-parallel target ranks exited without a report")
        if time.monotonic() > deadline:
            raise TimeoutError("the tensor-parallel target phase ran past its time limit")
