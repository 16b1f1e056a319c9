"""ZeRO-1's gradient reduction of one bucket, four ways (reduce-scatter, reduce, all-to-all,
all-reduce).

Legend as in `pipeline.parallel.zero_layout`: bucket b of a region's flat gradient buffer is d
pieces of s elements, piece q owned by dp rank q. Each way launches its collectives without
waiting and returns, per work handle, what to do once it has arrived.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from pipeline.parallel.data_parallel import CommStats
from pipeline.parallel.zero_layout import ShardLayout

__all__ = ["COLLECTIVES", "BucketReduction", "Finish", "Launched", "Waitable"]



class Waitable(Protocol):
    """A launched collective (a `dist.Work`, or an emulated one): `wait` returns once it
    has arrived."""

    def wait(self) -> object:
        """Block until the collective finished."""


Finish = Callable[[], None]
"""Completes one pending collective's bookkeeping once its work handle is waited."""
Launched = list[tuple[Waitable, Finish | None]]


@dataclass(frozen=True)
class BucketReduction:
    """One bucket to reduce: the flat gradient buffer, its layout, the bucket and the group."""

    flat_grad: torch.Tensor
    layout: ShardLayout
    b: int
    dp_rank: int
    group: ProcessGroup | None
    stats: CommStats

    @property
    def dp_size(self) -> int:
        return self.layout.dp_size

    def piece(self, rank: int) -> torch.Tensor:
        """Rank `rank`'s piece of the bucket (a view of the buffer)."""
        return self.flat_grad[slice(*self.layout.owned(self.b, rank))]


def reduce_scatter(bucket: BucketReduction) -> Launched:
    """The ring's reduce-scatter: each rank receives the sum of its piece."""
    pieces = [bucket.piece(q) for q in range(bucket.dp_size)]
    bucket.stats.record("reduce_scatter", *pieces)
    received = torch.empty_like(pieces[0])  # the output must not alias an input piece
    work = dist.reduce_scatter(received, pieces, group=bucket.group, async_op=True)

    def finish() -> None:
        bucket.piece(bucket.dp_rank).copy_(received)
    return [(_require(work), finish)]


def reduce_each(bucket: BucketReduction) -> Launched:
    """Sum each rank's piece into its owner, in place: no buffer; the other ranks' pieces
    of this rank's buffer are left as scratch (only the own shard is read after)."""
    works: Launched = []
    for owner in range(bucket.dp_size):
        piece = bucket.piece(owner)
        bucket.stats.record("reduce", piece)
        dst = owner if bucket.group is None else dist.get_global_rank(bucket.group, owner)
        works.append((_require(dist.reduce(piece, dst, group=bucket.group, async_op=True)),
                      None))
    return works


def exchange(bucket: BucketReduction) -> Launched:
    """Send rank q the piece of bucket b it owns, receive the other ranks' copies of ours,
    add them to our own piece in place."""
    d, me = bucket.dp_size, bucket.dp_rank
    layout = bucket.layout
    rows = bucket.flat_grad[slice(*layout.bucket(bucket.b))].view(d, layout.piece)
    # Our own piece need not travel: sent to ourselves it would cost a piece in the
    # receive buffer (half the bucket for d = 2). Without it the rest must be one tensor
    # in rank order: a view when ours is the first or last row; a rank in the middle
    # sends all rows (ours to itself) and sums them.
    if d == 1 or 0 < me < d - 1:
        pieces = rows
    else:
        pieces = rows[1:] if me == 0 else rows[:-1]
    splits = [1] * d  # rows of `pieces`, one per rank
    if pieces.shape[0] < d:
        splits[me] = 0
    received = torch.empty_like(pieces)
    bucket.stats.record("all_to_all", pieces)
    work = dist.all_to_all_single(received, pieces, output_split_sizes=splits,
                                  input_split_sizes=splits, group=bucket.group,
                                  async_op=True)

    def finish() -> None:
        shard = bucket.piece(me)
        if received.shape[0] == d:  # ours came back among them
            torch.sum(received, dim=0, out=shard)
            return
        for piece in received:
            shard.add_(piece)
    return [(_require(work), finish)]


def all_reduce(bucket: BucketReduction) -> Launched:
    """Fallback: reduce the whole bucket; this rank's piece of it is then in place."""
    whole = bucket.flat_grad[slice(*bucket.layout.bucket(bucket.b))]
    bucket.stats.record("all_reduce", whole)
    return [(_require(dist.all_reduce(whole, group=bucket.group, async_op=True)), None)]


COLLECTIVES: dict[str, Callable[[BucketReduction], Launched]] = {
    "reduce_scatter": reduce_scatter, "reduce": reduce_each, "all_to_all": exchange,
    "all_reduce": all_reduce}
"""`ShardedOptimizer.collective` -> how it reduces one bucket."""


def _require(work: dist.Work | None) -> dist.Work:
    if work is None:
        raise RuntimeError("an async_op=True collective returned no work handle")
    return work
