"""ZeRO's reducer role: launch, settle and clip the gradient reductions of a ZeRO optimizer.

Legend as in `pipeline.parallel.zero`: d = dp size, a region's (k, s) shard is this rank's r-th
piece of each of its k buckets. A mixin of `ShardedOptimizer` (and so of its ZeRO-2 / 3 forms,
which override its launch and settle steps): the `GradReducer` half of the optimizer, from
`last_backward` arming a region's hooks to the reduced shards the step reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch.distributed import ProcessGroup

from pipeline.parallel.data_parallel import CommStats
from pipeline.parallel.precision import clip_coefficient, counts_in_norm, global_grad_norm
from pipeline.parallel.zero_collectives import BucketReduction
from pipeline.parallel.zero_comm import ZeroCollectives
from pipeline.parallel.zero_inspect import ShardInspection
from pipeline.parallel.zero_region import ResolvedCollective, ShardRegion

__all__ = ["ShardReducer"]


class ShardReducer(ShardInspection):
    """Reduce-scatter a ZeRO optimizer's region gradients and read back the shards (see the
    module docstring); `ShardedOptimizer` builds the regions and steps them."""

    average: bool
    collective: ResolvedCollective
    stats: CommStats
    comm: ZeroCollectives

    def reduce_stage(self, stage_index: int, params: Sequence[torch.nn.Parameter]) -> None:
        """Launch the reduce-scatter of one region's gradients without waiting (the buckets
        its last backward did not launch already)."""
        region = self._regions.get(stage_index)
        trainable = {id(p) for p in params if p.requires_grad}
        if region is None:
            if trainable:
                raise KeyError(f"stage {stage_index} has no ZeRO region; regions are "
                               f"{sorted(self._regions)} (pass its parameters to "
                               f"ShardedOptimizer's params_by_stage)")
            return
        if trainable != {id(p) for p in region.params}:
            raise ValueError(
                f"reduce_stage({stage_index}) got {len(trainable)} trainable parameters but "
                f"the region holds {len(region.params)} different ones; pass the same "
                f"parameters as in params_by_stage[{stage_index}]")
        if region.reduced:
            raise RuntimeError(f"stage {stage_index} was reduced twice in one step; call "
                               f"step() (or zero_grad()) between steps")
        self._launch_reduce(region)

    def last_backward(self, stage_index: int) -> None:
        """The next backward of this stage is its last of the step: launch each bucket's
        reduction from the gradient hooks as soon as the bucket is final (overlap)."""
        region = self._regions.get(stage_index)
        if region is not None and region.grads is not None and region.grads.hooked \
                and not region.reduced:
            region.grads.arm()

    def wait(self) -> None:
        """Reduce every region not reduced yet, then block until all reductions finished;
        the shards then hold reduced gradients (the masters' `.grad`)."""
        for region in self._regions.values():
            if not region.reduced:
                self._launch_reduce(region)
        for region in self._regions.values():
            self._settle(region)

    def _settle(self, region: ShardRegion) -> None:
        """Wait for the region's launched reductions; point the master's `.grad` (and its
        pieces') at the reduced shard."""
        if not region.pending:
            return  # finished by an earlier wait; the shard may be clipped since
        for work, finish in region.pending:
            work.wait()
            if finish is not None:
                finish()
        region.pending.clear()
        self._point_grads(region, region.layout.shard(region.flat_grad, self.dp_rank))

    @staticmethod
    def _point_grads(region: ShardRegion, shard: torch.Tensor) -> None:
        region.master.grad = shard if shard.dtype == torch.float32 else shard.float()
        for piece in region.pieces:
            piece.tensor.grad = region.master.grad[piece.bucket, piece.row]

    def grad_shards(self) -> list[torch.Tensor]:
        """This rank's reduced fp32 gradient shards, (k, s) each (valid after `wait`):
        overflow checks, unscaling and clipping act on these, and the optimizer steps with
        them."""
        return [self._step_grad(region) for region in self._regions.values()]

    def clip_grad_norm_(self, max_norm: float, group: ProcessGroup | None, *,
                        tp_rank: int = 0) -> torch.Tensor:
        """Clip the reduced shards by the global norm; `group` must span every rank holding
        a shard (the world: dp shards × pp stages × tp ranks). Returns the total norm."""
        self.wait()
        pieces = list(self._norm_pieces(tp_rank))
        total = global_grad_norm(pieces, group)
        coefficient = clip_coefficient(total, max_norm)
        for shard in self.grad_shards():
            shard.mul_(coefficient)
        return total

    def _launch_reduce(self, region: ShardRegion) -> None:
        if region.grads is None:
            raise RuntimeError("internal error: a ZeRO region without its gradient buffer")
        # unhooked (tied) gradients, or ones accumulated before this optimizer existed
        region.grads.take_grads()
        region.grads.flush()
        region.reduced = True

    def _launch_bucket(self, region: ShardRegion, b: int) -> None:
        if self.average:
            # Divide before summing, as DDP does, so fp16 sums stay in range.
            region.flat_grad[slice(*region.layout.bucket(b))].div_(self.dp_size)
        bucket = BucketReduction(region.flat_grad, region.layout, b, self.dp_rank, self.group,
                                 self.stats)
        region.pending += self.comm.reduce_bucket(self.collective, bucket)

    def _norm_pieces(self, tp_rank: int) -> Iterable[torch.Tensor]:
        """Slices of the grad shards that belong to parameters counted in the norm."""
        for region in self._regions.values():
            shard = self._step_grad(region)
            for param, offset in zip(region.params, region.offsets):
                if not counts_in_norm(param, tp_rank):
                    continue
                for b, _, row in region.layout.overlaps(offset, param.numel(), self.dp_rank):
                    yield shard[b, row]
