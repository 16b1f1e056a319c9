"""ZeRO-1 shards per bucket (Megatron's layout): each bucket split d ways, rank r owning the r-th
d-th of every bucket, so a bucket's reduce-scatter can start as soon as that bucket is final.

The layout is checked against an ownership oracle written here from the definition, and the
live optimizer's reduced shards against the single-process gradient at the elements the oracle
gives each rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from pipeline.parallel.zero import ShardedOptimizer
from pipeline.parallel.zero_layout import ShardLayout
from tests.support.rank_harness import run_ranks

BUCKET_MB = 256 / 2**20  # 64 fp32 elements a bucket: every region takes several


def _owner(i: int, bucket_width: int, piece: int) -> int:
    """The oracle: element i lies in bucket i // (d·s), and in that bucket's (i mod d·s) // s
    -th piece, which that rank owns."""
    return (i % bucket_width) // piece


@given(numel=st.integers(0, 2000), d=st.integers(1, 8), bucket=st.integers(1, 300))
def test_every_element_is_owned_once_by_the_piece_of_its_bucket(numel: int, d: int,
                                                                bucket: int) -> None:
    layout = ShardLayout.plan(numel, d, bucket)
    k, s = layout.num_buckets, layout.piece
    assert layout.size == k * d * s >= numel
    assert layout.size - max(1, numel) < k * d  # equal buckets: under 1 element a piece padded
    assert d * s <= max(d, bucket - bucket % d)  # a bucket holds at most the asked elements
    assert (k - 1) * d * s < max(1, numel)  # no bucket is padding only
    flat = torch.arange(layout.size)
    owned = {r: layout.shard(flat, r).reshape(-1).tolist() for r in range(d)}
    for r in range(d):
        assert layout.shard(flat, r).shape == (k, s)
        assert owned[r] == [i for i in range(layout.size) if _owner(i, d * s, s) == r]
    assert sorted(i for r in range(d) for i in owned[r]) == list(range(layout.size))


@given(numel=st.integers(1, 600), d=st.integers(1, 6), bucket=st.integers(1, 100),
       cut=st.integers(0, 599), length=st.integers(1, 600))
def test_overlaps_find_exactly_the_owned_elements_of_a_range(numel: int, d: int, bucket: int,
                                                             cut: int, length: int) -> None:
    layout = ShardLayout.plan(numel, d, bucket)
    offset = cut % numel
    length = min(length, numel - offset)
    flat = torch.arange(layout.size)
    for r in range(d):
        shard = layout.shard(flat, r)
        found = []
        for b, own, row in layout.overlaps(offset, length, r):
            values = shard[b, row].tolist()
            assert values == list(range(offset + own.start, offset + own.stop))
            found += values
        assert found == [i for i in range(offset, offset + length)
                         if _owner(i, d * layout.piece, layout.piece) == r]


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 5))  # 63 + 50 elements


def _check_shards_hold_the_owned_reduced_gradient(rank: int, world_size: int) -> None:
    torch.manual_seed(1)
    x, y = torch.randn(8, 6), torch.randn(8, 5)
    reference = _model()
    nn.functional.mse_loss(reference(x), y).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    share = 8 // world_size
    for collective in ("reduce_scatter", "reduce", "all_reduce", "all_to_all"):
        model = _model()
        zero = ShardedOptimizer({0: list(model.parameters())}, _sgd, None,
                                bucket_mb=BUCKET_MB / 4,  # 16 elements: 8 buckets at d = 2
                                collective=collective)  # type: ignore[arg-type]
        local = slice(rank * share, (rank + 1) * share)
        nn.functional.mse_loss(model(x[local]), y[local]).backward()
        zero.wait()
        (shard,) = zero.grad_shards()
        layout = zero.layouts()[0]
        assert layout.num_buckets > 1, layout
        width = world_size * layout.piece
        mine = [i for i in range(layout.size) if _owner(i, width, layout.piece) == rank]
        oracle = torch.stack([expected[i] if i < expected.numel() else torch.tensor(0.0)
                              for i in mine])
        torch.testing.assert_close(shard.reshape(-1), oracle, msg=collective)


@pytest.mark.multiprocess
def test_reduced_shards_hold_each_ranks_piece_of_every_bucket() -> None:
    run_ranks(_check_shards_hold_the_owned_reduced_gradient, 2)


class _Probe(nn.Module):
    """Parameterless: when the backward reaches its output, records how many bucket
    reductions the optimizer has launched (only the layers after it are final then)."""

    def __init__(self) -> None:
        super().__init__()
        self.zero: Any = None
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 1.0
        y.register_hook(lambda grad: self.seen.append(self.zero.stats.calls))
        return y


def _launched_after_the_last_layer(rank: int, world_size: int) -> None:
    del rank
    torch.manual_seed(0)
    probe = _Probe()
    linears = [nn.Linear(32, 32) for _ in range(6)]
    model = nn.Sequential(*linears[:5], probe, linears[5])
    zero = ShardedOptimizer({0: [p for layer in linears for p in layer.parameters()]}, _sgd,
                            None, bucket_mb=BUCKET_MB, collective="reduce_scatter")
    probe.zero = zero
    zero.last_backward(0)
    model(torch.randn(4, 32)).square().mean().backward()
    zero.wait()
    # only the last Linear (1056 of 6336 elements) is final when the probe fires: the
    # buckets inside it are on the wire already. One range per rank would need the tail of
    # rank 0's range, at element 6336 / d - 1, i.e. half the backward at d = 2.
    assert world_size == 2 and len(probe.seen) == 1, probe.seen
    assert probe.seen[0] >= 1056 // 64, probe.seen


@pytest.mark.multiprocess
def test_bucket_reduction_starts_with_the_last_layers_backward() -> None:
    run_ranks(_launched_after_the_last_layer, 2)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)

