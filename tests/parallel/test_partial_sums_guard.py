"""The deferred tp sums are refused where tp ranks could bucket the marked parameters apart:
a tensor cut into tp parts of different sizes (an odd vocabulary) keeps the per-backward
hooks, so the sums always pair up (single process: the decision is local and the same on
every tp rank, as the full shapes are)."""

from __future__ import annotations

import torch
from torch import nn

from pipeline.parallel.data_parallel import NoOpGradReducer
from pipeline.parallel.partial_grad_reducer import (
    PartialSumReducer,
    defer_partial_sums,
    uneven_split,
)
from pipeline.parallel.tensor.shard_layout import ShardLayout, mark_sharded

__all__: list[str] = []


def _cut(rows: int, tp: int = 2) -> nn.Parameter:
    """Rank 0's part of a (rows × 4) tensor cut by rows over tp (`torch.tensor_split`)."""
    layout = ShardLayout(dim=0, blocks=(rows,), rank=0, size=tp)
    return mark_sharded(nn.Parameter(layout.shard(torch.zeros(rows, 4))), layout)


def test_uneven_split_from_the_definition() -> None:
    # tensor_split's parts of one block differ in size iff the block is not a multiple of tp
    for rows in range(2, 12):
        for tp in (2, 3, 4):
            sizes = {len(part) for part in torch.tensor_split(torch.arange(rows), tp)}
            assert uneven_split([_cut(rows, tp)]) == (len(sizes) > 1), (rows, tp)
    assert not uneven_split([nn.Parameter(torch.zeros(3))])  # whole on every tp rank


def test_an_odd_vocabulary_keeps_the_hooks_an_even_one_defers() -> None:
    norm = nn.Parameter(torch.ones(4))
    even = defer_partial_sums(NoOpGradReducer(), {0: [_cut(8), norm]}, zero_stage=0, tp=2)
    assert isinstance(even, PartialSumReducer)
    plain = NoOpGradReducer()
    odd = defer_partial_sums(plain, {0: [_cut(9), norm]}, zero_stage=0, tp=2)
    assert odd is plain  # planted: without the check this wraps, and the sums can mismatch
