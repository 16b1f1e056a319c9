"""The engine's deferred tp sum of partial gradients: once a step, before the dp reduction.

`defer_partial_sums` takes the tp hooks of a rank's marked parameters
(`pipeline.parallel.tensor.partial_grads`) over when the reducer holds each accumulated
gradient whole until it reduces it: plain data parallelism (ZeRO-0, `.grad`), ZeRO-1 (the
region's main-gradient buffer), or no data parallelism at all. The sum then runs

- at a stage's REDUCE_GRAD, before its dp reduction: one coalesced all-reduce per tp group;
- overlapped (`overlap_grad_reduce`): right before the first dp bucket holding a marked
  parameter is launched from the last backward's hooks (one per such bucket);
- at STEP, for whatever no REDUCE_GRAD summed (a stage the reducer reduces at `wait`).

ZeRO-2 / 3 reduce-scatter every backward (or keep only shards), so there the hooks stay and
sum per backward; a caller's own `gradient_reducer`, tied weights and a model with a tensor
cut into tp parts of different sizes (`uneven_split`) keep them too.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from torch import nn

from pipeline.parallel.data_parallel import BucketedGradReducer, GradReducer, OverlappingReducer
from pipeline.parallel.expert_reduction import ExpertSplitReducer
from pipeline.parallel.tensor.partial_grads import PartialGradSums, keep_hooks
from pipeline.parallel.tensor.shard_layout import layout_of
from pipeline.parallel.zero import ShardedOptimizer

__all__ = ["PartialSumReducer", "defer_partial_sums", "uneven_split"]


class PartialSumReducer:
    """A `GradReducer` that sums the tp-partial gradients of a stage (`sums`) before `inner`
    reduces it over dp, and any left at `wait`; every marked parameter once a step."""

    def __init__(self, inner: GradReducer, sums: PartialGradSums) -> None:
        self.inner, self.sums = inner, sums

    def __getattr__(self, name: str) -> Any:
        """The inner reducer's other attributes (its `stats`)."""
        return getattr(self.__dict__["inner"], name)

    def reduce_stage(self, stage_index: int, params: Sequence[nn.Parameter]) -> None:
        self.sums.sum_stage(stage_index)
        self.inner.reduce_stage(stage_index, params)

    def last_backward(self, stage_index: int) -> None:
        """Pass the overlap signal on (the buckets' `before_launch` sums)."""
        if isinstance(self.inner, OverlappingReducer):
            self.inner.last_backward(stage_index)

    def wait(self) -> None:
        self.sums.sum_all()
        self.inner.wait()
        self.sums.new_step()


def _bucket_reducers(reducer: GradReducer) -> Iterator[BucketedGradReducer]:
    if isinstance(reducer, ExpertSplitReducer):
        yield from _bucket_reducers(reducer.dense)
        yield reducer.experts
    elif isinstance(reducer, BucketedGradReducer):
        yield reducer


def uneven_split(params: Sequence[nn.Parameter]) -> bool:
    """Whether some parameter is cut into tp parts of different sizes (an odd vocabulary:
    `shard_layout`). The sums run as the dp buckets launch, so every tp rank must put the
    marked parameters in the same buckets; parts of different sizes can move a bucket's
    boundary on one tp rank only, and its sums would then not pair up: keep the hooks."""
    for param in params:
        layout = layout_of(param)
        if layout is not None and any(block % layout.size for block in layout.blocks):
            return True
    return False


def defer_partial_sums(reducer: GradReducer,
                       params_by_stage: Mapping[int, Sequence[nn.Parameter]], *,
                       zero_stage: int, tp: int, keep: Sequence[nn.Parameter] = ()
                       ) -> GradReducer:
    """`reducer` wrapped to sum the marked parameters of `params_by_stage` over tp once a
    step (their hooks removed, or never registered), when `zero_stage` is 0 or 1 and
    `tp` > 1 and every tp part of the same tensor has one size (`uneven_split`); else
    `reducer` unchanged, the hooks kept. `keep`: parameters whose hooks stay (tied
    weights)."""
    every = [p for params in params_by_stage.values() for p in params]
    if tp == 1 or zero_stage not in (0, 1) or uneven_split(every) or (
            zero_stage == 1 and not isinstance(reducer, ShardedOptimizer)):
        keep_hooks(every)  # (a module an earlier engine deferred)
        return reducer
    sums = PartialGradSums(params_by_stage, keep=keep)
    if isinstance(reducer, ShardedOptimizer):
        for buffer in reducer.grad_buffers():
            if buffer.hooked:
                sums.locate_with(buffer.params, buffer.main_grad)
                buffer.before_launch = sums.sum
    for bucketed in _bucket_reducers(reducer):
        bucketed.before_launch = sums.sum
    sums.take_over()
    return PartialSumReducer(reducer, sums)
