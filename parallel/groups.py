"""Process groups, built once from the topology and passed down explicitly.

Two torch.distributed worlds meet at the launch's rendezvous store, one after the other:
- the startup world (gloo) holds every rank, the orchestrator (rank 0) included: rank 0 hands
  the workers its control address and key over it (broadcast_control), then every rank
  leaves it (end_startup_world);
- the workers' world holds the workers alone (torch rank = tandem rank - 1), with the groups
  below. So the orchestrator never joins an NCCL communicator, and holds no process group
  while it serves: each gloo group costs its members a transport thread that wakes an idle
  process every 10 ms.
The worker groups use NCCL on CUDA devices and gloo on CPU devices:
- draft_tp: the draft's tensor-parallel ranks; target_tp: the target's;
- bridge: every worker, for draft -> target and target -> draft transfers (the workers'
  world itself, as is any group of every worker: no group of its own).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.topology import Topology

ADDRESS_BYTES = 256
KEY_BYTES = 32  # runtime.control.auth.LAUNCH_KEY_BYTES
WORKERS_PREFIX = "tandem_workers"  # the workers' world's keys in the rendezvous store


@dataclass(frozen=True)
class TPInfo:
    """One rank's place in a tensor-parallel group. group None or size 1 = no TP."""

    group: dist.ProcessGroup | None
    rank: int  # rank within the group
    size: int

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"bad TPInfo: rank {self.rank} of size {self.size}")
        if self.group is None and self.size > 1:
            raise ValueError(f"TPInfo of size {self.size} needs its process group")

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @classmethod
    def from_group(cls, group: dist.ProcessGroup | None) -> TPInfo:
        """This rank's TPInfo in `group` (None: no TP)."""
        if group is None:
            return cls(None, 0, 1)
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def check_group(self) -> None:
        """ValueError unless the group agrees with this TPInfo's rank and size."""
        size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if (size, rank) != (self.size, self.rank):
            raise ValueError(
                f"TPInfo says rank {self.rank} of {self.size}, but its group says "
                f"rank {rank} of {size}"
            )


@dataclass(frozen=True)
class Groups:
    """This rank's view of the process groups; a group is None where this rank is no member."""

    draft_tp: dist.ProcessGroup | None
    target_tp: dist.ProcessGroup | None
    bridge: dist.ProcessGroup | None
    draft_ranks: tuple[int, ...]
    target_ranks: tuple[int, ...]
    bridge_ranks: tuple[int, ...]


def torch_rank(rank: int) -> int:
    """A worker's rank in the workers' world (rank 0, the orchestrator, is not in it)."""
    return rank - 1


def init_world(
    rank: int, world_size: int, init_method: str, timeout_s: float, store: dist.Store | None = None
) -> dist.Store:
    """Join the startup world of all ranks (gloo; the orchestrator = rank 0) at the launch's
    rendezvous store (`store`, else the one `init_method` names), which is returned: the
    workers' world meets there later (build_groups), so rank 0 keeps it while it runs."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store, _, _ = next(dist.rendezvous(init_method, rank, world_size, timeout=timeout))
    # the prefix init_process_group gives a store it made from init_method itself
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("default_pg", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    return store


def end_startup_world() -> None:
    """Leave the startup world (every rank, after broadcast_control): its transport thread
    goes with it."""
    dist.destroy_process_group()


def backend_for(topology: Topology) -> str:
    kinds = {w.device.kind for w in topology.workers}
    return "nccl" if kinds == {"cuda"} else "gloo"


def build_groups(topology: Topology, rank: int, store: dist.Store, timeout_s: float) -> Groups:
    """Join the workers' world at `store` and create the worker groups (every worker calls
    this, in the same order; rank 0 does not). Non-members, and every member of a group of
    one rank, get None; a group of every worker is the workers' world itself (a lone
    worker joins none)."""
    backend = backend_for(topology)
    timeout = datetime.timedelta(seconds=timeout_s)
    workers = topology.worker_ranks
    if len(workers) > 1:  # one worker talks to nobody: no world, no thread
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(WORKERS_PREFIX, store),
            rank=torch_rank(rank),
            world_size=len(workers),
            timeout=timeout,
        )
    made: dict[str, dist.ProcessGroup | None] = {}
    for name, ranks in (
        ("draft_tp", topology.draft_ranks),
        ("target_tp", topology.target_ranks),
        ("bridge", workers),
    ):
        if len(ranks) == 1:
            # A group of one rank talks to nobody. Every rank takes this branch alike, so the
            # new_group calls stay in the same order everywhere.
            made[name] = None
        elif sorted(ranks) == sorted(workers):
            made[name] = dist.group.WORLD
        else:
            group = dist.new_group(
                ranks=[torch_rank(r) for r in ranks], backend=backend, timeout=timeout
            )
            made[name] = group if rank in ranks else None
    return Groups(
        draft_tp=made["draft_tp"],
        target_tp=made["target_tp"],
        bridge=made["bridge"],
        draft_ranks=tuple(topology.draft_ranks),
        target_ranks=tuple(topology.target_ranks),
        bridge_ranks=tuple(workers),
    )


def broadcast_control(address: str | None, key: bytes | None = None) -> tuple[str, bytes | None]:
    """Rank 0 tells every rank where its control socket listens and, if it made one for this
    launch, the HMAC key of the control frames (the startup world, gloo: only its members
    hear it, unlike the store's keys). Returns (address, key);
    the key is None where rank 0 sent none (a key file on every rank, or no key)."""
    buf = torch.zeros(ADDRESS_BYTES + 1 + KEY_BYTES, dtype=torch.uint8)
    if dist.get_rank() == 0:
        assert address is not None  # rank 0 gives it; the others pass None
        raw = address.encode()
        if len(raw) >= ADDRESS_BYTES:
            raise ValueError(f"control address too long: {address!r}")
        if key is not None and len(key) != KEY_BYTES:
            raise ValueError(f"launch key must be {KEY_BYTES} bytes, got {len(key)}")
        buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        if key is not None:
            buf[ADDRESS_BYTES] = 1
            buf[ADDRESS_BYTES + 1 :] = torch.tensor(list(key), dtype=torch.uint8)
    dist.broadcast(buf, src=0)
    raw = bytes(buf.tolist())
    address = raw[:ADDRESS_BYTES].rstrip(b"\0").decode()
    return address, (raw[ADDRESS_BYTES + 1 :] if raw[ADDRESS_BYTES] else None)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
