"""`small_all_reduce` (gather + broadcast on gloo, or over an engine's datagram link) gives what
`all_reduce` gives (bit for bit for integers and MAX; float sums up to the order of addition,
and the same bits on every rank), over the world and over a subgroup; other ops keep
`all_reduce`."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pipeline.parallel.local_p2p import LocalLink, open_local_link
from pipeline.parallel.small_reduce import small_all_reduce
from tests.support.rank_harness import run_ranks

pytestmark = pytest.mark.multiprocess


def _values(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rank)
    return (torch.randn(n, generator=generator) * 1e3).to(dtype)


def _check(rank: int, world_size: int) -> None:
    odd = dist.new_group([1, 3])  # every rank creates it; ranks 1 and 3 use it
    link = open_local_link(None, timeout=30)
    assert link is not None and link.spans(None) and link.spans(odd)
    for through in (None, link):
        _compare(rank, odd, through)
    link.close()


def _compare(rank: int, odd: dist.ProcessGroup, link: LocalLink | None) -> None:
    for n in (1, 2, 5, 9):
        for dtype in (torch.int64, torch.float32, torch.float64):
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN):
                ours, theirs = _values(rank, n, dtype), _values(rank, n, dtype)
                small_all_reduce(ours, op=op, link=link)
                dist.all_reduce(theirs, op=op)
                _same(ours, theirs, op, None)
                if rank in (1, 3):
                    ours, theirs = _values(rank, n, dtype), _values(rank, n, dtype)
                    small_all_reduce(ours, op=op, group=odd, link=link)
                    dist.all_reduce(theirs, op=op, group=odd)
                    _same(ours, theirs, op, odd)


def _link_of_a_subgroup(rank: int, world_size: int) -> None:
    pair = dist.new_group([0, 1])
    link = open_local_link(pair, timeout=30) if rank in (0, 1) else None
    if link is not None:  # it cannot reach ranks 2 and 3: the world's vote keeps gloo
        assert link.spans(pair) and not link.spans(None)
    ours = torch.tensor([rank, 10 * rank])
    small_all_reduce(ours, link=link)
    assert ours.tolist() == [6, 60]


def _same(ours: torch.Tensor, theirs: torch.Tensor, op: dist.ReduceOp,
          group: dist.ProcessGroup | None) -> None:
    if ours.is_floating_point() and op == dist.ReduceOp.SUM:
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-3)
    else:
        assert torch.equal(ours, theirs), (op, ours, theirs)
    everyone = [torch.empty_like(ours) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, ours, group=group)
    assert all(torch.equal(ours, other) for other in everyone), everyone


def test_small_all_reduce_equals_all_reduce() -> None:
    run_ranks(_check, 4)


def test_a_link_that_does_not_reach_every_rank_is_not_used() -> None:
    run_ranks(_link_of_a_subgroup, 4)
