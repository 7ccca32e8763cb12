"""Devices that name their node (`n1:0`): how a config reads them, and their check against
the launch's node layout (parallel.nodes). Each raises ConfigError naming the device's key
(`target.devices[1]`). A config that names no node is left as it is: its CUDA indices keep
the global numbering of earlier releases (docs/multinode.md)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from parallel.devices import Device, names_nodes, resolve_nodes
from parallel.nodes import NodeLayout
from runtime.errors import ConfigError

GUIDE = "docs/multinode.md"


def resolve_config_nodes(
    draft: Sequence[Device], target: Sequence[Device]
) -> tuple[tuple[Device, ...], tuple[Device, ...]]:
    """draft.devices and target.devices; where any device names its node, every bare one is
    a device of node 0 (`1` = `n0:1`), and a list that then names one device twice is an
    error."""
    lists = resolve_nodes(draft, target)
    for name, before, after in zip(("draft", "target"), (draft, target), lists):
        for i, device in enumerate(after):
            if device in after[:i]:
                raise ConfigError(
                    f"{name}.devices[{i}]",
                    f"device {before[i]} is {device}, "
                    f"listed twice: where a config names nodes, a device "
                    f"without one is a device of node 0",
                )
    return lists[0], lists[1]


def device_keys(cfg) -> dict[Device, str]:
    """Each distinct device and the key of its first place (draft.devices first)."""
    keys: dict[Device, str] = {}
    for name, model in (("draft", cfg.draft), ("target", cfg.target)):
        for i, device in enumerate(model.devices):
            keys.setdefault(device, f"{name}.devices[{i}]")
    return keys


def needed_ranks(cfg) -> str:
    """What the config asks of the launch, e.g. 'node 0: 2 ranks (the orchestrator and
    1 device), node 1: 2 ranks'."""
    counts: dict[int, int] = {0: 1}
    for device in device_keys(cfg):
        counts[device.node or 0] = counts.get(device.node or 0, 0) + 1
    parts = [
        f"node {node}: {count} rank{'s' if count != 1 else ''}"
        for node, count in sorted(counts.items())
    ]
    parts[0] += f" (the orchestrator and {counts[0] - 1} device{'s' if counts[0] != 2 else ''})"
    return ", ".join(parts)


def check_nodes(cfg, layout: NodeLayout, cuda_count: Callable[[], int] | None = None) -> None:
    """The config's named nodes against the launch, on every rank that can see it: each node
    exists, each worker rank runs on its device's node (rank 0 and node 0's devices first,
    then node 1's, ...), and this node's CUDA indices exist (`cuda_count`: how many GPUs
    this host has, asked only when one is named here)."""
    keys = device_keys(cfg)
    if not names_nodes(list(keys)):
        return
    for device, key in keys.items():
        if (device.node or 0) >= layout.nodes:  # resolved: a bare device is node 0's
            raise ConfigError(
                key,
                f"{device} names node {device.node}, but {layout.describe()} "
                f"(nodes count from 0; see {GUIDE})",
            )
    for worker in cfg.topology().workers:
        node = layout.node_of(worker.rank)
        if node is not None and node != worker.device.node:
            raise ConfigError(
                keys[worker.device],
                f"{worker.device} is rank {worker.rank}'s device, so rank "
                f"{worker.rank} must run on node {worker.device.node}, but "
                f"{layout.describe()}; the config needs {needed_ranks(cfg)}, "
                f"ranks placed node by node (see {GUIDE})",
            )
    here = [(d, k) for d, k in keys.items() if d.node == layout.node and d.kind == "cuda"]
    if here and cuda_count is not None:
        count = cuda_count()
        for device, key in here:
            if device.index >= count:
                raise ConfigError(
                    key,
                    f"device {device} does not exist: node {device.node} "
                    f"has {count} CUDA device(s) (torch.cuda.device_count() "
                    f"on rank {layout.rank}'s host)",
                )
