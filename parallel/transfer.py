"""Device-to-device transfers between the draft and the target groups over the bridge group.

Collectives take their group explicitly and are skipped when the group has one member
(Megatron-LM mappings style). Tensors stay on the worker's device: NCCL on GPU, gloo on CPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.groups import torch_rank
from parallel.mappings import group_size


def bridge_broadcast(
    tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Every bridge member ends with src's `tensor` (in place). src is a tandem rank."""
    if group_size(group) == 1:
        return tensor
    dist.broadcast(tensor, src=torch_rank(src), group=group)
    return tensor
