"""The global gradient norm with expert parallelism, each gradient element counted once.

Dense parameters are replicated over the dp × cp ranks of their stage, expert shards over
their expert-data-parallel group (dp · cp / ep ranks) while the ep ranks of a group hold
different experts. Megatron-Core sums the dense squares over its model-parallel group and
the expert squares over its expert-model-parallel group, then adds the two; here one
all-reduce over the world does both, each rank adding the dense squares only on replica 0
and its expert shards' only on the first replicas holding them (replica < ep), a replica
being a rank's index dp_rank · cp + cp_rank among its stage's dp × cp ranks (ep is carved
from them in that order, `Topology.ep_group`): every pipeline stage, every ep rank's
experts, once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed import ProcessGroup

from pipeline.parallel.expert_reduction import split_expert_parameters
from pipeline.parallel.precision import clip_coefficient, counts_in_norm, global_grad_norm

__all__ = ["ExpertReplicatedGrads", "expert_norm_pieces"]


def expert_norm_pieces(params: Sequence[nn.Parameter], dp_rank: int, ep: int,
                       tp_rank: int) -> list[torch.Tensor]:
    """The gradients this rank adds to the world's sum of squares (see the module);
    `dp_rank`: the rank's replica index dp_rank · cp + cp_rank (its dp rank at cp = 1)."""
    dense, experts = split_expert_parameters(params)
    counted = (dense if dp_rank == 0 else []) + (experts if dp_rank < ep else [])
    return [p.grad for p in counted if p.grad is not None and counts_in_norm(p, tp_rank)]


class ExpertReplicatedGrads:
    """`pipeline.parallel.optimizer_step.ReplicatedGrads` with expert parallelism: the same
    gradients, the norm summed over the world as `expert_norm_pieces` counts it."""

    def __init__(self, params: Sequence[nn.Parameter], world_group: ProcessGroup | None, *,
                 dp_rank: int, ep: int, tp_rank: int) -> None:
        self.params = list(params)
        self.world_group = world_group
        self.dp_rank = dp_rank
        self.ep = ep
        self.tp_rank = tp_rank

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def clip(self, max_norm: float) -> torch.Tensor:
        total = global_grad_norm(
            expert_norm_pieces(self.params, self.dp_rank, self.ep, self.tp_rank),
            self.world_group)
        coefficient = clip_coefficient(total, max_norm)
        for grad in self.grads():
            grad.mul_(coefficient.to(grad.dtype))
        return total

    def clear(self) -> None:
        pass
