"""parallel.groups on CPU (gloo), with real processes: the orchestrator takes no part in the
workers' world, a bridge of every worker is that world itself (one gloo transport thread a
worker), ranks map to the workers' world as tandem rank - 1, and a lone worker joins none."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os

import pytest
import torch
import torch.distributed as dist

from launcher.discovery import free_port
from parallel import groups as pgroups
from parallel.topology import Device, Topology, WorkerSpec
from parallel.transfer import bridge_broadcast

pytestmark = pytest.mark.timeout(120)

PAIR = Topology(
    (WorkerSpec(1, Device("cpu", 0), 0, None), WorkerSpec(2, Device("cpu", 1), None, 0)), (1,), (2,)
)
ALONE = Topology((WorkerSpec(1, Device("cpu", 0), 0, 0),), (1,), (1,))


def gloo_threads() -> int:
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as fh:
            names.append(fh.read().strip())
    return names.count("gloo_tcp_loop")


def worker(rank: int, port: int, out) -> None:
    """Tandem rank `rank` of PAIR: its groups, its gloo threads, a bridge broadcast from the
    target's leader (rank 2)."""
    store = dist.TCPStore(
        "127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=60)
    )
    groups = pgroups.build_groups(PAIR, rank, store, timeout_s=60)
    tokens = torch.full((3,), float(rank))
    bridge_broadcast(tokens, PAIR.target_leader, groups.bridge)
    out.put(
        (
            rank,
            groups.bridge is dist.group.WORLD,
            groups.draft_tp,
            groups.target_tp,
            dist.get_rank(),
            gloo_threads(),
            tokens.tolist(),
        )
    )
    pgroups.destroy()


def test_a_pair_of_workers_shares_one_world_and_no_more():
    port = free_port()
    store = dist.TCPStore(
        "127.0.0.1",
        port,
        2,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60),
    )  # rank 0's, as it serves
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(rank, port, out)) for rank in (1, 2)]
    for proc in procs:
        proc.start()
    try:
        got = sorted(out.get(timeout=90) for _ in procs)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    assert got == [
        (1, True, None, None, 0, 1, [2.0] * 3),
        (2, True, None, None, 1, 1, [2.0] * 3),
    ], got
    assert not dist.is_initialized()  # this process, rank 0's part, joined nothing
    del store


def test_a_lone_worker_joins_no_world():
    store = dist.HashStore()
    groups = pgroups.build_groups(ALONE, 1, store, timeout_s=10)
    assert (groups.draft_tp, groups.target_tp, groups.bridge) == (None, None, None)
    assert not dist.is_initialized() and gloo_threads() == 0
    tokens = torch.ones(2)
    assert bridge_broadcast(tokens, ALONE.draft_leader, groups.bridge) is tokens
