"""parallel.topology: ranks, TP groups and co-location as pure data (no processes)."""

from __future__ import annotations

import pytest

from parallel.topology import LaunchError, Topology, WorkerSpec, build_topology
from runtime.config import Device, load_config

pytestmark = pytest.mark.timeout(60)


def cpu(*indices: int) -> list[Device]:
    return [Device("cpu", i) for i in indices]


def cuda(*indices: int) -> list[Device]:
    return [Device("cuda", i) for i in indices]


def test_disjoint():
    topo = build_topology(cpu(0), cpu(1, 2))
    assert topo.world_size == 4 and topo.worker_ranks == (1, 2, 3)
    assert topo.workers == (
        WorkerSpec(1, Device("cpu", 0), 0, None),
        WorkerSpec(2, Device("cpu", 1), None, 0),
        WorkerSpec(3, Device("cpu", 2), None, 1),
    )
    assert topo.draft_ranks == (1,) and topo.target_ranks == (2, 3)
    assert topo.draft_leader == 1 and topo.target_leader == 2
    assert topo.worker(1).hosts_draft and not topo.worker(1).hosts_target
    assert topo.worker(3).hosts_target and not topo.worker(3).hosts_draft
    assert Topology.ORCHESTRATOR_RANK == topo.ORCHESTRATOR_RANK == 0


def test_overlapping():
    topo = build_topology(cuda(0), cuda(0, 1))
    assert topo.world_size == 3
    assert topo.workers == (
        WorkerSpec(1, Device("cuda", 0), 0, 0),
        WorkerSpec(2, Device("cuda", 1), None, 1),
    )
    assert topo.draft_ranks == (1,) and topo.target_ranks == (1, 2)
    assert topo.worker(1).hosts_draft and topo.worker(1).hosts_target
    assert topo.worker(1).roles == "draft+target"


def test_identical():
    topo = build_topology(cpu(0, 1), cpu(0, 1))
    assert topo.world_size == 3
    assert topo.draft_ranks == topo.target_ranks == (1, 2)
    assert all(w.draft_tp_rank == w.target_tp_rank == w.rank - 1 for w in topo.workers)


def test_identical_single_device():
    topo = build_topology(cpu(0), cpu(0))
    assert topo.world_size == 2 and topo.workers == (WorkerSpec(1, Device("cpu", 0), 0, 0),)


def test_partial_overlap_tp2_tp3():
    # draft TP 2 on [2, 0]; target TP 3 on [0, 1, 3]: device order 2, 0, 1, 3
    topo = build_topology(cuda(2, 0), cuda(0, 1, 3))
    assert topo.world_size == 5
    assert [str(w.device) for w in topo.workers] == ["cuda:2", "cuda:0", "cuda:1", "cuda:3"]
    assert topo.draft_ranks == (1, 2) and topo.target_ranks == (2, 3, 4)
    assert [(w.draft_tp_rank, w.target_tp_rank) for w in topo.workers] == [
        (0, None),
        (1, 0),
        (None, 1),
        (None, 2),
    ]
    assert topo.draft_leader == 1 and topo.target_leader == 2
    assert topo.draft_devices == tuple(cuda(2, 0))
    assert topo.target_devices == tuple(cuda(0, 1, 3))


def test_target_order_differs_from_draft_order():
    topo = build_topology(cpu(0, 1), cpu(1, 0))
    assert topo.draft_ranks == (1, 2) and topo.target_ranks == (2, 1)
    assert topo.target_leader == 2
    assert topo.worker(2).target_tp_rank == 0 and topo.worker(1).target_tp_rank == 1


def test_worker_lookup_errors():
    topo = build_topology(cpu(0), cpu(1))
    assert topo.worker(2).device == Device("cpu", 1)
    for rank in (0, 3, -1, 100):
        with pytest.raises(ValueError):
            topo.worker(rank)
    with pytest.raises(ValueError, match="orchestrator"):
        topo.worker(0)


def test_world_size_check():
    topo = build_topology(cpu(0), cpu(1, 2))
    topo.check_world_size(4)
    with pytest.raises(LaunchError) as info:
        topo.check_world_size(3)
    assert str(info.value) == (
        "world size 3 does not match the config: expected W=4 "
        "(1 orchestrator + 3 devices: cpu:0, cpu:1, cpu:2)"
    )
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(LaunchError, match="expected W=2"):
        build_topology(cuda(0), cuda(0)).check_world_size(1)


def test_describe():
    text = build_topology(cuda(0), cuda(0, 1)).describe()
    assert "world size 3" in text
    assert "rank 1 on cuda:0: draft tp 0/1, target tp 0/2" in text
    assert "rank 2 on cuda:1: target tp 1/2" in text


@pytest.mark.parametrize(
    "draft, target",
    [
        ([], cpu(0)),
        (cpu(0), []),
        (cpu(0, 0), cpu(1)),
        (cpu(0), cpu(1, 1)),
    ],
)
def test_build_rejects_bad_lists(draft, target):
    with pytest.raises(ValueError):
        build_topology(draft, target)


@pytest.mark.parametrize(
    "workers, draft_ranks, target_ranks",
    [
        ((WorkerSpec(2, Device("cpu", 0), 0, 0),), (2,), (2,)),  # not from 1
        (
            (WorkerSpec(1, Device("cpu", 0), 0, None), WorkerSpec(2, Device("cpu", 0), None, 0)),
            (1,),
            (2,),
        ),  # device twice
        ((WorkerSpec(1, Device("cpu", 0), 0, None),), (1,), ()),  # empty target
        (
            (WorkerSpec(1, Device("cpu", 0), 0, 0), WorkerSpec(2, Device("cpu", 1), None, None)),
            (1,),
            (1,),
        ),  # idle worker
        (
            (WorkerSpec(1, Device("cpu", 0), 0, 1), WorkerSpec(2, Device("cpu", 1), None, 0)),
            (1,),
            (1, 2),
        ),  # tp ranks swapped
        ((WorkerSpec(1, Device("cpu", 0), 0, 0),), (1,), (1, 1)),  # rank repeated
    ],
)
def test_post_init_validation(workers, draft_ranks, target_ranks):
    with pytest.raises(ValueError):
        Topology(workers, draft_ranks, target_ranks)


def test_from_config():
    cfg = load_config(
        {
            "draft": {"model": "/d", "devices": ["cpu:0"]},
            "target": {"model": "/t", "devices": ["cpu:0", "cpu:1"]},
        },
        check_files=False,
        check_devices=False,
    )
    topo = cfg.topology()
    assert topo == build_topology(cpu(0), cpu(0, 1))
    assert topo.world_size == 3
