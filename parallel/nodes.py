"""Where the launcher put the ranks: which node runs which rank, as far as one rank can tell.

Pure data, no processes: launcher.discovery fills it in from torchrun's environment or from
MPI, and runtime.config.nodes checks a config's node-qualified devices against it. Nodes are
numbered as the user numbers them in a config (`n1:0`): torchrun's node rank (GROUP_RANK,
`--node-rank`); under mpirun the hosts in the order of their lowest rank. Either way the
node of rank 0 (the orchestrator) is node 0.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["NodeLayout"]


@dataclass(frozen=True)
class NodeLayout:
    launcher: str  # who placed the ranks, in words: "torchrun", ...
    nodes: int  # how many nodes the job spans
    rank_nodes: tuple[int | None, ...]  # the node of each rank (index: rank); None: not known
    rank: int = 0  # the rank that sees this layout

    def __post_init__(self) -> None:
        object.__setattr__(self, "rank_nodes", tuple(self.rank_nodes))
        if self.nodes < 1:
            raise ValueError(f"a launch spans at least one node, got {self.nodes}")
        for node in self.rank_nodes:
            if node is not None and not 0 <= node < self.nodes:
                raise ValueError(f"node {node} out of range: {self.nodes} node(s)")

    @classmethod
    def one_host(cls, launcher: str, world_size: int | None = None) -> NodeLayout:
        """Every rank on this host (spawned by rank 0: world_size None, any size)."""
        return cls(launcher, 1, (0,) * (world_size or 0))

    @classmethod
    def from_blocks(
        cls,
        launcher: str,
        nodes: int,
        world_size: int,
        rank: int,
        blocks: Mapping[int, tuple[int, int]],
    ) -> NodeLayout:
        """Contiguous ranks per node (torchrun): blocks {node: (first rank, rank count)} for
        the nodes this rank knows of; rank 0 is on node 0 whatever else is known."""
        rank_nodes: list[int | None] = [None] * world_size
        for node, (first, count) in blocks.items():
            for r in range(first, min(first + count, world_size)):
                rank_nodes[r] = node
        if world_size:
            rank_nodes[0] = 0
        return cls(launcher, nodes, tuple(rank_nodes), rank)

    @classmethod
    def from_hosts(cls, launcher: str, hosts: Sequence[Hashable], rank: int) -> NodeLayout:
        """One host key per rank (MPI: the lowest rank on that host): nodes in the order of
        their first rank."""
        order: dict[Hashable, int] = {}
        for host in hosts:
            order.setdefault(host, len(order))
        return cls(launcher, max(len(order), 1), tuple(order[h] for h in hosts), rank)

    def node_of(self, rank: int) -> int | None:
        """The node of `rank`; None where this rank cannot know it."""
        if self.nodes == 1:
            return 0
        return self.rank_nodes[rank] if 0 <= rank < len(self.rank_nodes) else None

    @property
    def node(self) -> int:
        """This rank's own node."""
        node = self.node_of(self.rank)
        return 0 if node is None else node

    def describe(self) -> str:
        """E.g. 'torchrun runs 2 nodes: node 0: ranks 0-1, node 1: ranks 2-3'."""
        noun = "node" if self.nodes == 1 else "nodes"
        if self.nodes == 1:
            return f"{self.launcher} runs every rank on 1 node (node 0)"
        parts = []
        for node in range(self.nodes):
            ranks = [r for r, n in enumerate(self.rank_nodes) if n == node]
            which = (
                f"rank{'s' if len(ranks) > 1 else ''} {_spans(ranks)}"
                if ranks
                else "ranks not known here"
            )
            parts.append(f"node {node}: {which}")
        return f"{self.launcher} runs {self.nodes} {noun}: {', '.join(parts)}"


def _spans(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out: list[str] = []
    start = prev = ranks[0]
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(out)
