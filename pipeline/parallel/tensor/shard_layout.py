"""How a tensor-parallel parameter was cut from its full tensor, so loads slice and exports merge.

A full tensor may stack several blocks along the cut dimension (a fused Q;K;V or gate;up
projection); each block is cut into tp parts separately, and a rank holds its part of every
block, in order. Parts follow `torch.tensor_split` (sizes differ by at most one), so an odd
vocabulary (GPT-2's 50,257) splits over any tp, as Megatron's padded vocabulary does without
the padding; heads and FFN columns are checked to divide evenly where they are built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch

from pipeline.parallel.param_marks import mark_tensor_parallel

__all__ = ["ShardLayout", "layout_of", "mark_sharded"]

_LAYOUT = "pipesched_shard_layout"
_T = TypeVar("_T", bound=torch.Tensor)


@dataclass(frozen=True)
class ShardLayout:
    """Rank `rank` of `size` holds, along `dim`, its part of each block of `blocks`."""

    dim: int
    """The dimension cut (0: output rows of a Linear; 1: its input columns)."""
    blocks: tuple[int, ...]
    """Sizes along `dim` of the full tensor's stacked blocks (one block: unfused)."""
    rank: int
    size: int

    def _parts(self, full: torch.Tensor) -> list[list[torch.Tensor]]:
        if full.shape[self.dim] != sum(self.blocks):
            raise ValueError(f"a full tensor of shape {tuple(full.shape)} does not have "
                             f"{sum(self.blocks)} = {' + '.join(map(str, self.blocks))} "
                             f"along dim {self.dim}; is it the same model's tensor?")
        return [list(torch.tensor_split(block, self.size, dim=self.dim))
                for block in torch.split(full, list(self.blocks), dim=self.dim)]

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full tensor (a contiguous copy)."""
        return torch.cat([parts[self.rank] for parts in self._parts(full)],
                         dim=self.dim).contiguous()

    def ranges(self) -> list[tuple[int, int]]:
        """[start, end) along `dim` of the full tensor for each of this rank's pieces."""
        out, offset = [], 0
        for block in self.blocks:
            base, extra = divmod(block, self.size)
            start = offset + self.rank * base + min(self.rank, extra)
            out.append((start, start + base + (self.rank < extra)))
            offset += block
        return out

    def merge(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's shard (index = tp rank)."""
        if len(shards) != self.size:
            raise ValueError(f"merge needs {self.size} shards, got {len(shards)}")
        sizes = [[hi - lo for lo, hi in ShardLayout(self.dim, self.blocks, r, self.size)
                  .ranges()] for r in range(self.size)]
        pieces = [torch.split(shard, sizes[r], dim=self.dim) for r, shard in enumerate(shards)]
        return torch.cat([pieces[r][b] for b in range(len(self.blocks))
                          for r in range(self.size)], dim=self.dim)


def mark_sharded(param: _T, layout: ShardLayout) -> _T:
    """Record that `param` is `layout`'s part of a full tensor (a tp slice along its dim)."""
    mark_tensor_parallel(param, layout.dim)  # type: ignore[arg-type]
    setattr(param, _LAYOUT, layout)
    return param


def layout_of(param: torch.Tensor) -> ShardLayout | None:
    """How `param` was cut (None: every tp rank holds it whole)."""
    layout = getattr(param, _LAYOUT, None)
    return layout if isinstance(layout, ShardLayout) else None
