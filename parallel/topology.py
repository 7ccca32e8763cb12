"""Who is who in a tandem run: pure data, no processes, no torch.distributed.

Rank 0 is the orchestrator. Every distinct device of draft.devices ∪ target.devices gets one
worker rank (1, 2, ...), in order of first appearance in draft.devices, then target.devices.
A device in both lists hosts both shards (co-location), so no two ranks share a device.
Devices that name their node (parallel.devices) take their ranks node by node, as torchrun
and mpirun place ranks: rank 0 and node 0's devices first, then node 1's, and so on (within
a node, in order of first appearance); parallel.nodes checks that against the launch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from parallel.devices import Device

__all__ = ["LaunchError", "WorkerSpec", "Topology", "build_topology"]


class LaunchError(RuntimeError):
    """The processes that were started do not match the config (world size, ranks, ...)."""


@dataclass(frozen=True)
class WorkerSpec:
    rank: int  # global rank, >= 1 (rank 0 is the orchestrator)
    device: Device
    draft_tp_rank: int | None  # index in draft.devices, None if no draft shard here
    target_tp_rank: int | None  # index in target.devices, None if no target shard here

    @property
    def hosts_draft(self) -> bool:
        return self.draft_tp_rank is not None

    @property
    def hosts_target(self) -> bool:
        return self.target_tp_rank is not None

    @property
    def roles(self) -> str:
        """'draft', 'target' or 'draft+target'."""
        return "+".join(
            name for name, on in (("draft", self.hosts_draft), ("target", self.hosts_target)) if on
        )


def _check_group(workers: tuple[WorkerSpec, ...], ranks: tuple[int, ...], name: str) -> None:
    if not ranks:
        raise ValueError(f"topology: the {name} group is empty")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"topology: {name}_ranks {ranks} repeat a rank")
    attr = f"{name}_tp_rank"
    hosts = {w.rank: getattr(w, attr) for w in workers if getattr(w, attr) is not None}
    expected = {rank: tp for tp, rank in enumerate(ranks)}
    if hosts != expected:
        raise ValueError(
            f"topology: {name}_ranks {ranks} disagree with the workers' {attr} values {hosts}"
        )


@dataclass(frozen=True)
class Topology:
    workers: tuple[WorkerSpec, ...]  # ordered by rank 1..W-1
    draft_ranks: tuple[int, ...]  # global ranks of the draft TP group, in TP-rank order
    target_ranks: tuple[int, ...]
    ORCHESTRATOR_RANK: ClassVar[int] = 0

    def __post_init__(self) -> None:
        for name in ("workers", "draft_ranks", "target_ranks"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        ranks = [w.rank for w in self.workers]
        if ranks != list(range(1, len(self.workers) + 1)):
            raise ValueError(
                f"topology: worker ranks must be 1..{len(self.workers)} in order, got {ranks}"
            )
        devices = [w.device for w in self.workers]
        if len(set(devices)) != len(devices):
            raise ValueError(
                f"topology: a device hosts two workers: {', '.join(map(str, devices))}"
            )
        for w in self.workers:
            if not (w.hosts_draft or w.hosts_target):
                raise ValueError(f"topology: rank {w.rank} ({w.device}) hosts no model shard")
        _check_group(self.workers, self.draft_ranks, "draft")
        _check_group(self.workers, self.target_ranks, "target")

    @property
    def world_size(self) -> int:
        return 1 + len(self.workers)

    @property
    def worker_ranks(self) -> tuple[int, ...]:
        return tuple(w.rank for w in self.workers)

    @property
    def draft_leader(self) -> int:
        return self.draft_ranks[0]

    @property
    def target_leader(self) -> int:
        return self.target_ranks[0]

    @property
    def devices(self) -> tuple[Device, ...]:
        """The worker devices in rank order (rank r has devices[r - 1])."""
        return tuple(w.device for w in self.workers)

    @property
    def draft_devices(self) -> tuple[Device, ...]:
        return tuple(self.worker(r).device for r in self.draft_ranks)

    @property
    def target_devices(self) -> tuple[Device, ...]:
        return tuple(self.worker(r).device for r in self.target_ranks)

    def worker(self, rank: int) -> WorkerSpec:
        """The WorkerSpec of a worker rank; ValueError for rank 0 or a rank out of range."""
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise ValueError(f"rank must be an integer, got {rank!r}")
        if rank == self.ORCHESTRATOR_RANK:
            raise ValueError("rank 0 is the orchestrator, not a worker")
        if not 1 <= rank < self.world_size:
            raise ValueError(
                f"rank {rank} is out of range: worker ranks are "
                f"1..{self.world_size - 1} (world size {self.world_size})"
            )
        return self.workers[rank - 1]

    def check_world_size(self, world_size: int) -> None:
        """Raise LaunchError unless world_size == 1 orchestrator + one rank per device."""
        if (
            isinstance(world_size, int)
            and not isinstance(world_size, bool)
            and world_size == self.world_size
        ):
            return
        n = len(self.workers)
        noun = "device" if n == 1 else "devices"
        raise LaunchError(
            f"world size {world_size} does not match the config: expected "
            f"W={self.world_size} (1 orchestrator + {n} {noun}: "
            f"{', '.join(map(str, self.devices))})"
        )

    def describe(self) -> str:
        """A few human-readable lines for logs."""
        lines = [
            f"world size {self.world_size}: rank 0 orchestrator; "
            f"draft TP {len(self.draft_ranks)} on ranks {list(self.draft_ranks)}, "
            f"target TP {len(self.target_ranks)} on ranks {list(self.target_ranks)}"
        ]
        for w in self.workers:
            parts = []
            if w.hosts_draft:
                parts.append(f"draft tp {w.draft_tp_rank}/{len(self.draft_ranks)}")
            if w.hosts_target:
                parts.append(f"target tp {w.target_tp_rank}/{len(self.target_ranks)}")
            lines.append(f"  rank {w.rank} on {w.device}: {', '.join(parts)}")
        return "\n".join(lines)


def _as_devices(devices: Sequence[Device], name: str) -> list[Device]:
    try:
        out = [Device.parse(d) for d in devices]
    except ValueError as exc:
        raise ValueError(f"{name}.devices: {exc}") from None
    if not out:
        raise ValueError(f"{name}.devices: must list at least one device")
    for i, d in enumerate(out):
        if d in out[:i]:
            raise ValueError(f"{name}.devices: device {d} is listed twice")
    return out


def build_topology(draft_devices: Sequence[Device], target_devices: Sequence[Device]) -> Topology:
    """One worker per distinct device, ranks in order of first appearance (draft, then
    target); devices that name their node, node by node (stable within a node)."""
    draft = _as_devices(draft_devices, "draft")
    target = _as_devices(target_devices, "target")
    order: list[Device] = []
    for d in draft + target:
        if d not in order:
            order.append(d)
    order.sort(key=lambda d: d.node or 0)  # stable: no named node, no change
    workers = tuple(
        WorkerSpec(
            rank=i + 1,
            device=d,
            draft_tp_rank=draft.index(d) if d in draft else None,
            target_tp_rank=target.index(d) if d in target else None,
        )
        for i, d in enumerate(order)
    )
    rank_of = {d: i + 1 for i, d in enumerate(order)}
    return Topology(
        workers=workers,
        draft_ranks=tuple(rank_of[d] for d in draft),
        target_ranks=tuple(rank_of[d] for d in target),
    )
