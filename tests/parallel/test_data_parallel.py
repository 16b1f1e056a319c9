"""Bucketed data-parallel gradient reduction: averages equal the full-batch gradient."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from pipeline.parallel.data_parallel import (
    BucketedGradReducer,
    GradReducer,
    NoOpGradReducer,
    broadcast_parameters,
    split_into_buckets,
)
from tests.support.rank_harness import run_ranks


@given(sizes=st.lists(st.tuples(st.integers(1, 40), st.sampled_from([torch.float32,
                                                                       torch.float64])),
                      max_size=12),
       bucket_bytes=st.integers(1, 200))
def test_buckets_cover_every_tensor_once_without_mixing_dtypes(
        sizes: list[tuple[int, torch.dtype]], bucket_bytes: int) -> None:
    tensors = [torch.zeros(n, dtype=dtype) for n, dtype in sizes]
    buckets = split_into_buckets(tensors, bucket_bytes)
    assert sorted(i for bucket in buckets for i in bucket) == list(range(len(tensors)))
    for bucket in buckets:
        assert len({tensors[i].dtype for i in bucket}) == 1
        assert bucket == sorted(bucket)
        size = sum(tensors[i].numel() * tensors[i].element_size() for i in bucket)
        assert size <= bucket_bytes or len(bucket) == 1


def test_noop_reducer_leaves_gradients_alone() -> None:
    param = nn.Parameter(torch.ones(3))
    param.grad = torch.full((3,), 2.0)
    reducer: GradReducer = NoOpGradReducer()
    reducer.reduce_stage(0, [param])
    reducer.wait()
    assert torch.equal(param.grad, torch.full((3,), 2.0))


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    model.unused = nn.Parameter(torch.ones(2))  # never gets a gradient: reduced as zeros
    model.double_param = nn.Parameter(torch.ones(3, dtype=torch.float64))  # own bucket dtype
    return model


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x) + model.double_param.float().sum()
    return nn.functional.mse_loss(out, y)


def _check_average(rank: int, world_size: int) -> None:
    torch.manual_seed(100)
    x, y = torch.randn(8, 5), torch.randn(8, 3)  # the global batch, same on every rank
    reference = _model()
    _loss(reference, x, y).backward()

    torch.manual_seed(rank)  # replicas start different; the broadcast makes them equal
    model = _model() if rank == 0 else nn.Sequential(nn.Linear(5, 7), nn.Tanh(),
                                                     nn.Linear(7, 3))
    if rank != 0:
        model.unused = nn.Parameter(torch.zeros(2))
        model.double_param = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    broadcast_parameters(list(model.parameters()), None)
    for mine, ref in zip(model.parameters(), reference.parameters()):
        assert torch.equal(mine.data, ref.data)

    local = slice(rank * 4, (rank + 1) * 4)  # each replica passes its own part of the batch
    _loss(model, x[local], y[local]).backward()
    reducer = BucketedGradReducer(None, bucket_mb=64 / 2**20)  # 64-byte buckets: several
    params = list(model.parameters())
    reducer.reduce_stage(1, params[2:])  # the later stage finishes its backward first
    reducer.reduce_stage(0, params[:2])
    reducer.wait()
    for (name, mine), ref in zip(model.named_parameters(), reference.parameters()):
        expected = torch.zeros_like(ref) if ref.grad is None else ref.grad
        assert mine.grad is not None, name
        torch.testing.assert_close(mine.grad, expected, msg=name)
    assert reducer.stats.calls >= 4
    total = sum(p.numel() * p.element_size() for p in params)
    assert reducer.stats.payload_bytes == total


@pytest.mark.multiprocess
def test_bucketed_reducer_averages_to_the_global_batch_gradient() -> None:
    run_ranks(_check_average, 2)
