"""ZeRO-1's parameter groups: the user's groups over model parameters, carried onto the shards.

Legend as in `pipeline.parallel.zero_layout`: a region's flat buffer is cut into k buckets of
d·s elements and this rank's (k, s) master shard holds the r-th piece of each. A *shard
piece* is where one model parameter meets one row of that shard: a 1-D view of the master.

The optimizer factory is called with the model's parameters, names and shapes as the user
sees them, so the usual split (``p.ndim < 2``: no weight decay) and per-group learning rates
mean what they mean without ZeRO. Each group then steps the pieces of its parameters: the
group dicts (and so their hyperparameters, and what an LR scheduler writes into them) are the
factory's own. Megatron's distributed optimizer (`_build_model_and_main_param_groups`) and
DeepSpeed's ZeRO (one flat partition per group) keep the user's groups the same way; here a
piece list per group stands in for a flat buffer per group, so the gradient buckets stay in
backward order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pipeline.parallel.zero_layout import ShardLayout

__all__ = ["ShardPiece", "carry_groups", "cut_pieces"]


@dataclass(frozen=True)
class ShardPiece:
    """One parameter's elements inside one row of this rank's master shard."""

    param: nn.Parameter
    """The model's parameter."""
    elements: slice
    """Which of its (flattened) elements this piece holds."""
    bucket: int
    row: slice
    """The same elements in row `bucket` of the region's (k, s) master."""
    tensor: nn.Parameter
    """``master[bucket, row]``: a view the inner optimizer updates in place."""


def cut_pieces(params: Sequence[nn.Parameter], offsets: Sequence[int], layout: ShardLayout,
               dp_rank: int, master: torch.Tensor) -> list[ShardPiece]:
    """Every parameter's pieces of this rank's shard, in the flat buffer's order."""
    pieces = []
    for param, offset in zip(params, offsets):
        for b, elements, row in layout.overlaps(offset, param.numel(), dp_rank):
            # a Parameter made from a view shares its storage: updates land in the master
            view = nn.Parameter(master.detach()[b, row])
            pieces.append(ShardPiece(param, elements, b, row, view))
    return pieces


def carry_groups(optimizer: torch.optim.Optimizer, pieces: Sequence[ShardPiece],
                 params: Sequence[nn.Parameter]) -> None:
    """Replace, in place, each group's model parameters by their pieces of this rank's shard.

    `optimizer` was built by the user's factory over `params` and has not stepped. A
    parameter in no group is not stepped, as torch would not step it. Refuses an optimizer
    holding tensors other than `params` (built over another model, or a copy).
    """
    if optimizer.state:
        raise ValueError("the optimizer factory returned an optimizer that holds state "
                         "already; under zero_stage=1 it must be a fresh optimizer over the "
                         "parameters it is given")
    mine = {id(param) for param in params}
    stray = [tuple(p.shape) for group in optimizer.param_groups for p in group["params"]
             if id(p) not in mine]
    if stray:
        raise ValueError(
            f"the optimizer factory's optimizer holds {len(stray)} tensors (shapes "
            f"{stray[:3]}) that are not this rank's trainable parameters; build it over the "
            f"parameters the factory is given, e.g. `lambda params: torch.optim.AdamW(params)`"
            f" or groups split from them")
    by_param: dict[int, list[nn.Parameter]] = {}
    for piece in pieces:
        by_param.setdefault(id(piece.param), []).append(piece.tensor)
    for group in optimizer.param_groups:
        # in place: some optimizers (LBFGS) keep a reference to the list itself
        group["params"][:] = [tensor for param in group["params"]
                              for tensor in by_param.get(id(param), [])]
