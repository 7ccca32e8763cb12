"""Devices that name their node (`n1:0`): parsing, equality, the config's reading of bare
devices beside them, rank order, and the checks against simulated torchrun / mpirun / spawn
node layouts (no processes)."""

import os
import subprocess
import sys

import pytest

from launcher.discovery import LaunchEnv, discover, torchrun_layout
from parallel.devices import Device
from parallel.nodes import NodeLayout
from parallel.topology import build_topology
from runtime.config import ConfigError, load_config
from runtime.config.nodes import check_nodes


def _cfg(draft, target, **kwargs):
    raw = {"draft": {"model": "/d", "devices": draft}, "target": {"model": "/t", "devices": target}}
    return load_config(raw, check_files=False, check_devices=False, **kwargs)


def _torchrun(world, locals_):
    """The layout each rank sees under torchrun with nodes of `locals_` ranks each."""
    layouts, rank = [], 0
    for node, local in enumerate(locals_):
        for local_rank in range(local):
            env = {
                "WORLD_SIZE": str(world),
                "RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(local),
                "LOCAL_RANK": str(local_rank),
                "GROUP_RANK": str(node),
                "GROUP_WORLD_SIZE": str(len(locals_)),
            }
            layouts.append(torchrun_layout(env))
            rank += 1
    return layouts


@pytest.mark.parametrize(
    "text, device",
    [
        ("n1:0", Device("cuda", 0, 1)),
        ("n1:cuda:3", Device("cuda", 3, 1)),
        ("n2:cuda", Device("cuda", 0, 2)),
        ("n1:cpu:0", Device("cpu", 0, 1)),
        (" N0:CPU ", Device("cpu", 0, 0)),
        ("n10:7", Device("cuda", 7, 10)),
        (1, Device("cuda", 1)),
        ("cpu:2", Device("cpu", 2)),
    ],
)
def test_parse_and_round_trip(text, device):
    assert Device.parse(text) == device
    assert Device.parse(str(device)) == device


@pytest.mark.parametrize("text", ["n1", "n:0", "nx:0", "n-1:0", "n1:n1:0", "node1:0", "1:0"])
def test_bad_node_syntax(text):
    with pytest.raises(ValueError, match="n1:0"):
        Device.parse(text)


def test_equality_and_str():
    assert Device.parse("n0:0") != Device.parse("n1:0")
    assert Device.parse("0") != Device.parse("n0:0")  # until a config resolves the bare one
    assert len({Device.parse(t) for t in ("n0:0", "n1:0", "n1:cuda:0", "0")}) == 3
    assert str(Device("cuda", 1, 1)) == "n1:cuda:1" and str(Device("cpu", 0)) == "cpu:0"
    with pytest.raises(ValueError, match="node"):
        Device("cuda", 0, -1)


def test_single_node_configs_read_as_before():
    cfg = _cfg([0], [1, 2])
    assert cfg.target.devices == (Device("cuda", 1), Device("cuda", 2))
    assert cfg.to_dict()["target"]["devices"] == ["cuda:1", "cuda:2"]


def test_bare_devices_are_node_0_beside_named_ones():
    cfg = _cfg([0], ["n1:0", "n1:1"])
    assert cfg.draft.devices == (Device("cuda", 0, 0),)
    assert cfg.target.devices == (Device("cuda", 0, 1), Device("cuda", 1, 1))
    assert (
        _cfg(
            **{
                "draft": cfg.to_dict()["draft"]["devices"],
                "target": cfg.to_dict()["target"]["devices"],
            }
        )
        == cfg
    )
    with pytest.raises(ConfigError, match=r"^draft\.devices\[1\]: device cuda:0 is n0:cuda:0"):
        _cfg(["n0:0", 0], ["n1:0"])
    colocated = _cfg([0], ["n0:0", "n1:0"])  # `0` and `n0:0` are one device
    assert colocated.topology().world_size == 3 and not colocated.overlapped


def test_ranks_go_node_by_node():
    topo = build_topology([Device("cuda", 0, 1)], [Device("cuda", 0, 0), Device("cuda", 1, 0)])
    assert [str(d) for d in topo.devices] == ["n0:cuda:0", "n0:cuda:1", "n1:cuda:0"]
    assert topo.draft_ranks == (3,) and topo.target_ranks == (1, 2)
    same = build_topology([Device("cuda", 0, 1)], [Device("cuda", 0, 1), Device("cuda", 0, 0)])
    assert same.world_size == 3 and same.worker(2).roles == "draft+target"
    assert same.target_ranks == (2, 1)


def test_torchrun_layouts_from_env():
    for layout in _torchrun(4, [2, 2]):
        assert layout.rank_nodes == (0, 0, 1, 1) and layout.nodes == 2
    assert [layout.node for layout in _torchrun(5, [2, 3])] == [0, 0, 1, 1, 1]
    assert _torchrun(5, [2, 3])[3].rank_nodes == (0, 0, 1, 1, 1)
    partial = _torchrun(7, [1, 3, 3])[2]  # 3 nodes: only its own block is known
    assert partial.rank_nodes == (0, 1, 1, 1, None, None, None)
    assert "node 2: ranks not known here" in partial.describe()
    alone = torchrun_layout(
        {
            "WORLD_SIZE": "3",
            "RANK": "1",
            "LOCAL_WORLD_SIZE": "3",
            "LOCAL_RANK": "1",
            "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1",
        }
    )
    assert alone.nodes == 1 and alone.node_of(2) == 0


def test_mpi_hosts_number_nodes_by_their_lowest_rank():
    by_slot = NodeLayout.from_hosts("mpirun", [0, 0, 2, 2], rank=3)
    assert by_slot.rank_nodes == (0, 0, 1, 1) and by_slot.node == 1
    by_node = NodeLayout.from_hosts("mpirun", [0, 1, 0, 1], rank=0)
    assert by_node.describe() == "mpirun runs 2 nodes: node 0: ranks 0, 2, node 1: ranks 1, 3"


def test_matching_layouts_pass_on_every_rank():
    cfg = _cfg(["n0:0"], ["n1:0", "n1:1"])
    for layout in _torchrun(4, [2, 2]) + [NodeLayout.from_hosts("mpirun", [0, 0, 2, 2], 0)]:
        check_nodes(cfg, layout, cuda_count=lambda: 2)
    check_nodes(_cfg(["n0:cpu:0"], ["n0:cpu:1"]), NodeLayout.one_host("tandem run"))
    # no node named: today's global numbering, nothing to check
    check_nodes(_cfg([0], [2, 3]), _torchrun(4, [2, 2])[0], cuda_count=lambda: 2)


def test_a_node_the_launch_lacks_names_its_key():
    cfg = _cfg(["n0:0"], ["n1:0", "n2:0"])
    with pytest.raises(
        ConfigError,
        match=r"^target\.devices\[1\]: n2:cuda:0 names node 2, "
        r"but torchrun runs 2 nodes: node 0: ranks 0-1, "
        r"node 1: ranks 2-3",
    ):
        check_nodes(cfg, _torchrun(4, [2, 2])[0])
    with pytest.raises(
        ConfigError,
        match=r"^target\.devices\[0\]: .*tandem run runs every "
        r"rank on 1 node",
    ):
        check_nodes(_cfg([0], ["n1:0"]), NodeLayout.one_host("tandem run"))


def test_ranks_on_the_wrong_node_name_the_key_and_the_layout():
    cfg = _cfg(["n0:0", "n0:1"], ["n1:0"])  # needs 3 ranks on node 0, torchrun has 2
    for layout in _torchrun(4, [2, 2]):
        with pytest.raises(
            ConfigError,
            match=r"^draft\.devices\[1\]: n0:cuda:1 is rank 2's "
            r"device.*node 0: 3 ranks \(the orchestrator "
            r"and 2 devices\), node 1: 1 rank",
        ):
            check_nodes(cfg, layout)
    by_node = NodeLayout.from_hosts("mpirun", [0, 1, 0, 1], rank=0)
    with pytest.raises(
        ConfigError,
        match=r"^draft\.devices\[0\]: .*mpirun runs 2 nodes: "
        r"node 0: ranks 0, 2, node 1: ranks 1, 3",
    ):
        check_nodes(_cfg(["n0:0"], ["n1:0", "n1:1"]), by_node)


def test_this_nodes_cuda_indices_are_checked_here():
    cfg = _cfg(["n0:0"], ["n1:0", "n1:1"])
    node0, node1 = _torchrun(4, [2, 2])[0], _torchrun(4, [2, 2])[2]
    check_nodes(cfg, node0, cuda_count=lambda: 1)  # node 0 needs only CUDA 0
    with pytest.raises(
        ConfigError,
        match=r"^target\.devices\[1\]: device n1:cuda:1 does not "
        r"exist: node 1 has 1 CUDA device",
    ):
        check_nodes(cfg, node1, cuda_count=lambda: 1)


def test_discover_reads_torchrun_layout(monkeypatch):
    env = {
        "RANK": "2",
        "WORLD_SIZE": "4",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "TORCHELASTIC_RUN_ID": "x",
    }
    monkeypatch.delenv("TANDEM_LAUNCH", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    launch = discover()
    assert (launch.method, launch.rank, launch.layout.node) == ("torchrun", 2, 1)
    assert LaunchEnv("spawn", 0, None, None).layout.nodes == 1


def test_mpi_layout_runs_its_collectives():
    """mpi_layout's MPI calls (plain int buffers) in a singleton MPI process of its own, so
    that this test process never initialises MPI."""
    pytest.importorskip("mpi4py")
    code = (
        "from mpi4py import MPI; from launcher.discovery import mpi_layout; "
        "print(mpi_layout(MPI.COMM_WORLD).describe())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "TANDEM_LAUNCH"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "mpirun runs every rank on 1 node (node 0)"
