"""Rank discovery: who am I, how many ranks are there, and where do we rendezvous.

Four launch forms (INTERFACE.md) map to these methods:
- "spawn": plain `tandem run`; this process is rank 0 and starts the workers itself;
- "torchrun": RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT from torchrun's environment;
- "mpi": `mpirun -n W`; ranks from MPI.COMM_WORLD, the rendezvous port sent by MPI from rank 0;
- "mpi-spawn": `mpirun -n 1`; rank 0 starts the workers with MPI_Comm_spawn;
- "child": a worker started by rank 0 (spawn or mpi-spawn), told its rank on the command line.
"""

from __future__ import annotations

import os
import signal
import socket
from dataclasses import dataclass, field

from parallel.nodes import NodeLayout

MPI_ENV_KEYS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PMI_RANK", "MPI_LOCALNRANKS")


@dataclass(frozen=True)
class LaunchEnv:
    method: str  # spawn | torchrun | mpi | mpi-spawn | child
    rank: int
    world_size: int | None  # None: rank 0 decides (spawn, mpi-spawn)
    init_method: str | None  # torch.distributed init method; None: rank 0 picks a port
    layout: NodeLayout = field(default_factory=lambda: NodeLayout.one_host("tandem run"))

    @property
    def is_orchestrator(self) -> bool:
        return self.rank == 0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def under_torchrun() -> bool:
    env = os.environ
    return "TORCHELASTIC_RUN_ID" in env or (
        "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env
    )


def multi_node() -> bool:
    """Whether this launch spans several hosts (torchrun or MPI tell us how many ranks are
    local); then CUDA ids in the config are local to each rank's node."""
    env = os.environ
    pairs = (
        ("LOCAL_WORLD_SIZE", "WORLD_SIZE"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_SIZE"),
        ("MPI_LOCALNRANKS", "PMI_SIZE"),
    )
    return any(local in env and total in env and env[local] != env[total] for local, total in pairs)


def under_mpi() -> bool:
    return any(key in os.environ for key in MPI_ENV_KEYS)


def survive_mpi_fault_notice() -> None:
    """MPICH's hydra, run with -disable-auto-cleanup, tells the surviving ranks that one died
    with SIGUSR1, whose default action ends the process: ignore it (silently: hydra may end
    the job on any output after a failure), so that rank 0 lives to name the dead rank (it
    finds out on its own)."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def discover() -> LaunchEnv:
    if os.environ.get("TANDEM_LAUNCH") == "spawn":  # Engine.launch's child: always spawn
        return LaunchEnv("spawn", 0, None, None)
    if under_torchrun():
        return LaunchEnv(
            "torchrun",
            int(os.environ["RANK"]),
            int(os.environ["WORLD_SIZE"]),
            "env://",
            torchrun_layout(os.environ),
        )
    if under_mpi():
        survive_mpi_fault_notice()
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        if comm.Get_size() == 1:
            return LaunchEnv(
                "mpi-spawn",
                0,
                None,
                None,
                NodeLayout.one_host("mpirun -n 1 (rank 0 spawns the workers)"),
            )
        init_method = _mpi_init_method(comm)
        return LaunchEnv("mpi", comm.Get_rank(), comm.Get_size(), init_method, mpi_layout(comm))
    return LaunchEnv("spawn", 0, None, None)


def torchrun_layout(env) -> NodeLayout:
    """torchrun places ranks node by node: node g (GROUP_RANK) runs LOCAL_WORLD_SIZE ranks
    from RANK - LOCAL_RANK on, of GROUP_WORLD_SIZE nodes. A rank knows its own node's block,
    and with 1 or 2 nodes every block (the other node holds the rest)."""
    world, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
    local = int(env.get("LOCAL_WORLD_SIZE", world))
    first = rank - int(env.get("LOCAL_RANK", 0))
    node = int(env.get("GROUP_RANK", first // max(local, 1)))
    nodes = int(env.get("GROUP_WORLD_SIZE", -(-world // max(local, 1))))
    nodes = max(nodes, node + 1)
    blocks = {node: (first, local)}
    if nodes == 2:
        other = (0, first) if node == 1 else (local, world - local)
        blocks[1 - node] = other
    return NodeLayout.from_blocks("torchrun", nodes, world, rank, blocks)


def mpi_layout(comm) -> NodeLayout:
    """Each rank's host, told apart by MPI (the ranks that share memory), named by the lowest
    rank on it; exchanged as plain ints (nothing pickled)."""
    from array import array

    from mpi4py import MPI

    node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    lowest = array("i", [0])
    node_comm.Allreduce([array("i", [comm.Get_rank()]), MPI.INT], [lowest, MPI.INT], op=MPI.MIN)
    node_comm.Free()
    hosts = array("i", [0] * comm.Get_size())
    comm.Allgather([lowest, MPI.INT], [hosts, MPI.INT])
    return NodeLayout.from_hosts("mpirun", list(hosts), comm.Get_rank())


def _mpi_init_method(comm) -> str:
    """Rank 0 picks a rendezvous address and sends it to all ranks as raw bytes (no pickle)."""
    buf = bytearray(256)
    if comm.Get_rank() == 0:
        host = os.environ.get("TANDEM_MASTER_ADDR") or _own_address()
        raw = f"tcp://{host}:{free_port(host if host != '127.0.0.1' else '127.0.0.1')}".encode()
        buf[: len(raw)] = raw
    from mpi4py import MPI

    comm.Bcast([buf, MPI.BYTE], root=0)
    return bytes(buf).rstrip(b"\0").decode()


def _own_address() -> str:
    """Loopback when every MPI rank is on this host, else this host's name."""
    local = os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE") or os.environ.get("MPI_LOCALNRANKS")
    size = os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE")
    if local is not None and size is not None and local != size:
        return socket.gethostname()
    return "127.0.0.1"
