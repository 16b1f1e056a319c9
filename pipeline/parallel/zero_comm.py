"""The collectives ZeRO's optimizers launch, behind one object (a seam: time them emulated).

`ZeroCollectives` is what `ShardedOptimizer` (ZeRO-1), `GradShardedOptimizer` (ZeRO-2) and
`FullyShardedOptimizer` (ZeRO-3) call for every gradient-bucket reduction and parameter
all-gather, as `TensorParallelOps` is for the tensor-parallel layers: the real one below runs
torch.distributed's; `pipeline.rehearsal.emulated_zero` times them on an emulated link
instead (`ShardedOptimizer.use_collectives`). Every method launches without waiting and
returns handles whose `wait` completes the collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from pipeline.parallel.flat_collectives import all_gather_flat
from pipeline.parallel.zero_collectives import COLLECTIVES, BucketReduction, Launched, Waitable

__all__ = ["Waitable", "ZeroCollectives"]


class ZeroCollectives:
    """torch.distributed's collectives, as ZeRO launches them (async, one handle each)."""

    def reduce_bucket(self, way: str, bucket: BucketReduction) -> Launched:
        """Launch one gradient bucket's reduction `way` (`zero_collectives.COLLECTIVES`)."""
        return COLLECTIVES[way](bucket)

    def gather_flat(self, out: torch.Tensor, local: torch.Tensor,
                    group: ProcessGroup | None) -> Waitable:
        """Launch the all-gather of every rank's `local` into `out` (rank order)."""
        return _require(all_gather_flat(out, local, group, async_op=True))

    def gather_pieces(self, outputs: list[torch.Tensor], local: torch.Tensor,
                      group: ProcessGroup | None) -> Waitable:
        """Launch the all-gather of every rank's `local` into `outputs[rank]`."""
        return _require(dist.all_gather(outputs, local, group=group, async_op=True))


def _require(work: Waitable | None) -> Waitable:
    if work is None:
        raise RuntimeError("an async_op=True all-gather returned no work handle")
    return work
