"""ZeRO-2 inside pipeline stages: optimizer state and gradients sharded over the dp group.

Legend as in `pipeline.parallel.zero_layout` (d = dp size, a region's k buckets of d·s
elements, rank r's (k, s) shard). Everything of ZeRO-1 (`ShardedOptimizer`: regions per
stage, the fp32 master shard, the parameter all-gather after the step) except where the
gradients live: ZeRO-1 keeps each region's whole main-gradient buffer through the step and
reduce-scatters it once after the stage's last backward; ZeRO-2 reduce-scatters every
backward's buckets as they fill (`pipeline.parallel.zero_grad_store`) and keeps only the
(k, s) shard, so after the step a rank holds 4Ψ/d gradient bytes (fp32) instead of 4Ψ, at
the price of m reductions a step instead of one. Half parameters (bf16 / fp16) keep a
half gradient shard (2Ψ/d) and its fp32 copy only through the step (DeepSpeed's 2 + 14/d).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.distributed import ProcessGroup

from pipeline.parallel.data_parallel import DEFAULT_BUCKET_MB
from pipeline.parallel.optimizer import OptimizerFactory
from pipeline.parallel.tied_sync import TIED_REGION
from pipeline.parallel.zero import ShardedOptimizer
from pipeline.parallel.zero_collectives import BucketReduction, Launched
from pipeline.parallel.zero_grad_store import ShardGradStore
from pipeline.parallel.zero_layout import ShardLayout
from pipeline.parallel.zero_region import Collective, ShardRegion

__all__ = ["GradShardedOptimizer"]


class GradShardedOptimizer(ShardedOptimizer):
    """ZeRO-2: a `ShardedOptimizer` whose gradients are reduce-scattered into this rank's
    shard during every backward (the constructor's arguments are `ShardedOptimizer`'s).

    Also a reducer the interpreter tells when one backward of a stage ended
    (`backward_done`): the buckets that did not fill launch then, on every replica at the
    same point. `last_backward` is not needed (every backward's gradients are final for
    their bucket) and does nothing.
    """

    MAX_IN_FLIGHT = 2
    """Bucket reductions a rank keeps in flight (over all its regions): launching one more
    first waits for the oldest, so the transient buffers alive stay about two buckets (and
    the bucket filling), not a whole backward's gradients (DeepSpeed's two ipg buffers)."""

    def __init__(self, params_by_stage: Mapping[int, Sequence[nn.Parameter]],
                 optimizer_factory: OptimizerFactory, group: ProcessGroup | None, *,
                 bucket_mb: float = DEFAULT_BUCKET_MB, average: bool = True,
                 collective: Collective = "auto", overlap_param_gather: bool = False) -> None:
        self._window: deque[tuple[ShardGradStore, torch.Tensor]] = deque()
        """Launched (store, bucket buffer), oldest first (some settled by now)."""
        super().__init__(params_by_stage, optimizer_factory, group, bucket_mb=bucket_mb,
                         average=average, collective=collective,
                         overlap_param_gather=overlap_param_gather)

    def backward_done(self, stage_index: int) -> None:
        """One B or W of `stage_index` ended: launch its region's unfilled buckets."""
        region = self._regions.get(stage_index)
        if region is not None and region.store is not None and region.store.hooked:
            region.store.backward_done()

    def last_backward(self, stage_index: int) -> None:
        """Nothing to arm: ZeRO-2 launches buckets in every backward."""
        del stage_index

    def _attach_grads(self, key: int, region: ShardRegion, grad_dtype: torch.dtype) -> None:
        layout = region.layout
        region.store = ShardGradStore(
            region.params, region.offsets, layout, grad_dtype, self.dp_rank,
            lambda b, buffer: self._reduce_bucket(buffer, layout),
            hooked=key != TIED_REGION, on_send=self._bound_in_flight)

    def _bound_in_flight(self, store: ShardGradStore, buffer: torch.Tensor) -> None:
        """Keep at most `MAX_IN_FLIGHT` launched reductions unsettled (the oldest first: every
        replica launched them in the same order, so waiting cannot deadlock)."""
        self._window.append((store, buffer))
        while len(self._window) > self.MAX_IN_FLIGHT:
            oldest, held = self._window.popleft()
            oldest.settle_oldest(held)

    def _reduce_bucket(self, buffer: torch.Tensor, layout: ShardLayout) -> Launched:
        """Launch the reduction of one bucket's transient buffer (d pieces of s)."""
        if self.average:
            buffer.div_(self.dp_size)  # before the sum, as DDP, so fp16 sums stay in range
        one_bucket = ShardLayout(layout.dp_size * layout.piece, layout.dp_size, 1, layout.piece)
        return self.comm.reduce_bucket(self.collective, BucketReduction(
            buffer, one_bucket, 0, self.dp_rank, self.group, self.stats))

    def _launch_reduce(self, region: ShardRegion) -> None:
        store = _store(region)
        store.take_grads()  # unhooked (tied) gradients, summed over their owners by now
        store.flush()
        region.reduced = True

    @staticmethod
    def _grad_dtype(param_dtype: torch.dtype) -> torch.dtype:
        """Gradients are reduced and kept in the parameters' dtype: half parameters keep a
        half shard (DeepSpeed's ZeRO-2 / 3: 2 + 14/d and 16/d bytes per parameter)."""
        return param_dtype

    def _settle(self, region: ShardRegion) -> None:
        shard = _store(region).settle()
        # a half shard's fp32 copy is made once a step (a second wait keeps the clipped one)
        if shard.dtype == torch.float32 or region.master.grad is None:
            self._point_grads(region, shard)

    def _step_grad(self, region: ShardRegion) -> torch.Tensor:
        """The fp32 gradient the step sees; after the step (its fp32 copy released) a half
        shard's, read back in fp32 (as the step saw it, rounded to the half dtype)."""
        store = region.store
        if region.master.grad is None and store is not None \
                and store.shard.dtype != torch.float32:
            return store.shard.float()
        return super()._step_grad(region)

    def publish(self) -> None:
        """Release the fp32 gradient copies (half parameters), then publish as ZeRO-1."""
        self._release_fp32_grads()
        super().publish()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ZeRO-1's; also drops the fp32 copies of half shards a skipped step left."""
        self._release_fp32_grads()
        super().zero_grad(set_to_none)

    def _release_fp32_grads(self) -> None:
        """Half shards: write the fp32 gradient the step saw (clipped, unscaled) back into the
        shard and drop the copy, so only the half shard (2/d bytes) outlives the step."""
        for region in self._regions.values():
            grad, store = region.master.grad, region.store
            if grad is None or store is None or store.shard.dtype == torch.float32:
                continue
            with torch.no_grad():
                store.shard.copy_(grad)
            region.master.grad = None
            for piece in region.pieces:
                piece.tensor.grad = None


def _store(region: ShardRegion) -> ShardGradStore:
    if region.store is None:
        raise RuntimeError("internal error: a ZeRO-2 region without its gradient shard")
    return region.store
