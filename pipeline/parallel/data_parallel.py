"""Data-parallel gradient reduction: one bucketed, non-blocking all-reduce per stage and step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from pipeline.parallel.grad_buffer import BucketLaunches

__all__ = [
    "DEFAULT_BUCKET_MB",
    "BucketedGradReducer",
    "CommStats",
    "GradReducer",
    "NoOpGradReducer",
    "OverlappingReducer",
    "broadcast_buffers",
    "broadcast_parameters",
    "grad_or_zeros",
    "make_grad_reducer",
    "split_into_buckets",
]

DEFAULT_BUCKET_MB = 25.0
"""DDP's default bucket size (`bucket_cap_mb`)."""


@runtime_checkable
class GradReducer(Protocol):
    """What the engine calls to reduce gradients across data-parallel replicas.

    - `reduce_stage(stage_index, params)` at a stage's REDUCE_GRAD instruction, i.e. once per
      step after that stage's last backward. It must not block: it launches communication
      so the reduction overlaps the compute of the rank's other stages.
    - `wait()` at STEP, before the optimizer step: afterwards every gradient is reduced.
    """

    def reduce_stage(self, stage_index: int, params: Sequence[torch.nn.Parameter]) -> None: ...

    def wait(self) -> None: ...


@runtime_checkable
class OverlappingReducer(GradReducer, Protocol):
    """A `GradReducer` that can start reducing inside a stage's last backward.

    `last_backward(stage_index)` is called right before the stage's last backward of the
    step (its last B); the reducer may then launch bucket reductions from gradient hooks as
    buckets become final. `reduce_stage` still follows, and launches whatever is left.
    """

    def last_backward(self, stage_index: int) -> None: ...


@dataclass
class CommStats:
    """Bytes this rank handed to collectives since the last `reset` (payload, not wire bytes)."""

    calls: int = 0
    payload_bytes: int = 0
    by_collective: dict[str, int] = field(default_factory=dict)

    def record(self, collective: str, *tensors: torch.Tensor) -> None:
        size = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
        self.calls += 1
        self.payload_bytes += size
        self.by_collective[collective] = self.by_collective.get(collective, 0) + size

    def reset(self) -> None:
        self.calls, self.payload_bytes = 0, 0
        self.by_collective.clear()


class NoOpGradReducer:
    """The reducer for dp = 1: gradients are already complete."""

    def reduce_stage(self, stage_index: int, params: Sequence[torch.nn.Parameter]) -> None:
        del stage_index, params

    def wait(self) -> None:
        pass


def split_into_buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int
                       ) -> list[list[int]]:
    """Indices of `tensors` grouped into buckets of at most `bucket_bytes` (a tensor larger
    than a bucket gets its own), never mixing dtypes, since a bucket is one flat buffer."""
    buckets: list[list[int]] = []
    open_bucket: dict[torch.dtype, tuple[list[int], int]] = {}
    for index, tensor in enumerate(tensors):
        size = tensor.numel() * tensor.element_size()
        members, filled = open_bucket.get(tensor.dtype, ([], 0))
        if members and filled + size > bucket_bytes:
            buckets.append(members)
            members, filled = [], 0
        members.append(index)
        open_bucket[tensor.dtype] = (members, filled + size)
    buckets.extend(members for members, _ in open_bucket.values() if members)
    return buckets


@dataclass
class _PendingBucket:
    work: dist.Work
    flat: torch.Tensor
    grads: list[torch.Tensor]


class BucketedGradReducer:
    """Average gradients over the data-parallel group, per stage, in buckets, asynchronously.

    Each replica computes the mean loss over its own dp-th of the global batch, so the mean of
    the replicas' gradients is the gradient of the mean loss over the global batch; the
    division by dp happens before the sum (as DDP does) so fp16 gradients do not overflow in
    the reduction. A parameter without a gradient is reduced as zeros: every replica must
    issue the same collectives in the same order, whatever its data touched.
    """

    def __init__(self, group: ProcessGroup | None, *,
                 bucket_mb: float = DEFAULT_BUCKET_MB, average: bool = True) -> None:
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}; DDP's default is "
                             f"{DEFAULT_BUCKET_MB}")
        self.group = group
        self.dp_size = dist.get_world_size(group)
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.average = average
        self.stats = CommStats()
        self.before_launch: Callable[[Sequence[torch.nn.Parameter]], None] | None = None
        """Called with a bucket's parameters right before its all-reduce (the deferred tp
        sum of partial gradients, `pipeline.parallel.partial_grad_reducer`)."""
        self._pending: list[_PendingBucket] = []
        self._watched: dict[int, tuple[list[torch.nn.Parameter], list[list[int]],
                                       BucketLaunches]] = {}

    def watch(self, stage_index: int, params: Sequence[torch.nn.Parameter]) -> None:
        """Prepare the overlap of one stage (DDP's buckets): its buckets, last parameters
        first (a backward finalises them first), launched from gradient hooks during the
        stage's last backward once `last_backward` armed them. `reduce_stage` must then name
        the same parameters."""
        order = [param for param in params if param.requires_grad][::-1]
        members = split_into_buckets(order, self.bucket_bytes)
        launches = BucketLaunches(members, len(order),
                                  lambda b: self._launch(order, members[b]))
        self._watched[stage_index] = (order, members, launches)
        for k, param in enumerate(order):
            param.register_post_accumulate_grad_hook(_mark_final(launches, k))

    def last_backward(self, stage_index: int) -> None:
        """The stage's last backward of the step follows: launch buckets as they fill."""
        watched = self._watched.get(stage_index)
        if watched is not None:
            watched[2].arm()

    def reduce_stage(self, stage_index: int, params: Sequence[torch.nn.Parameter]) -> None:
        """Launch the all-reduce of `params`' gradients (one stage's) without waiting (the
        buckets its last backward did not launch already, for a watched stage)."""
        watched = self._watched.get(stage_index)
        if watched is None:
            grads = [param for param in params if param.requires_grad]
            for members in split_into_buckets(grads, self.bucket_bytes):
                self._launch(grads, members)
            return
        order, _, launches = watched
        if {id(p) for p in params if p.requires_grad} != {id(p) for p in order}:
            raise ValueError(f"reduce_stage({stage_index}) got other parameters than "
                             f"watch({stage_index}) did; pass the same ones")
        launches.flush()
        launches.reset()

    def _launch(self, params: Sequence[torch.nn.Parameter], members: Sequence[int]) -> None:
        """All-reduce one bucket: the gradients of `params[i]` for i in `members`."""
        if self.before_launch is not None:
            self.before_launch([params[i] for i in members])
        bucket_grads = [grad_or_zeros(params[i]) for i in members]
        flat = torch.cat([grad.reshape(-1) for grad in bucket_grads])
        if self.average:
            flat.div_(self.dp_size)
        self.stats.record("all_reduce", flat)
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        if work is None:  # only without async_op; keeps the type checker honest
            raise RuntimeError("all_reduce(async_op=True) returned no work handle")
        self._pending.append(_PendingBucket(work, flat, bucket_grads))

    def wait(self) -> None:
        """Block until every launched bucket is reduced, and write the results back."""
        for bucket in self._pending:
            bucket.work.wait()
            offset = 0
            for grad in bucket.grads:
                grad.copy_(bucket.flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        self._pending.clear()


def make_grad_reducer(group: ProcessGroup | None, *, bucket_mb: float = DEFAULT_BUCKET_MB
                      ) -> GradReducer:
    """`NoOpGradReducer` when the group has one rank, else a `BucketedGradReducer`."""
    if dist.get_world_size(group) == 1:
        return NoOpGradReducer()
    return BucketedGradReducer(group, bucket_mb=bucket_mb)


def _mark_final(launches: BucketLaunches, k: int) -> Callable[[torch.Tensor], None]:
    def hook(_: torch.Tensor) -> None:
        if launches.armed:
            launches.final(k)
    return hook


def grad_or_zeros(param: torch.nn.Parameter) -> torch.Tensor:
    """`param.grad`, zeros when it has none: every rank of a group must reduce the same
    tensors, whatever its data touched."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad


def broadcast_parameters(params: Sequence[torch.nn.Parameter], group: ProcessGroup | None
                         ) -> None:
    """Copy dp rank 0's parameter values to every replica (collective over `group`), so the
    replicas start identical whatever each one's random state (DDP does this on wrap)."""
    if dist.get_world_size(group) == 1:
        return
    source = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for param in params:
            dist.broadcast(param.data, src=source, group=group)


def broadcast_buffers(buffers: Sequence[torch.Tensor], group: ProcessGroup | None) -> None:
    """Copy dp rank 0's buffers to every replica (collective over `group`): DDP's
    ``broadcast_buffers``. One broadcast per dtype, of the buffers laid end to end."""
    if dist.get_world_size(group) == 1 or not buffers:
        return
    source = dist.get_global_rank(group, 0) if group is not None else 0
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for buffer in buffers:
        by_dtype.setdefault(buffer.dtype, []).append(buffer)
    with torch.no_grad():
        for same in by_dtype.values():
            flat = torch.cat([buffer.reshape(-1) for buffer in same])
            dist.broadcast(flat, src=source, group=group)
            offset = 0
            for buffer in same:
                buffer.copy_(flat[offset:offset + buffer.numel()].view_as(buffer))
                offset += buffer.numel()
