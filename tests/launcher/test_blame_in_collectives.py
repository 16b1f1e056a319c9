"""A rank that dies without a word inside a tensor-parallel collective is named, not the
partner whose collective it broke (issue 49 item 3: "Connection reset by peer" on rank 0
was reported as rank 0's own failure when rank 1 called os._exit(1) mid-forward)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeline import LayerSpec, PipelineEngine, PipelineModule, RankFailedError, launch
from pipeline.launcher.results import RankReport, Result, failure_error
from pipeline.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear


class ExitsOnRankOne(nn.Module):
    """Leaves with os._exit(1) on rank 1 in its second forward (between the column layer's
    and the row layer's tp collectives); the identity elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if dist.get_rank() == 1 and self.calls == 2:
            os._exit(1)
        return x


def _train_tp2() -> None:
    layers = [LayerSpec(ColumnParallelLinear, 4, 8), LayerSpec(ExitsOnRankOne),
              LayerSpec(RowParallelLinear, 8, 4)]
    module = PipelineModule(layers, num_stages=1, loss_fn=F.mse_loss)
    engine = PipelineEngine(module, num_microbatches=2, tensor_parallel=2, timeout=20)
    for _ in range(2):
        engine.train_batch(torch.zeros(4, 4), torch.zeros(4, 4))


@pytest.mark.multiprocess
def test_a_rank_leaving_inside_a_tp_collective_is_named_not_its_partner() -> None:
    with pytest.raises(RankFailedError) as caught:
        launch(_train_tp2, 2, timeout=20, join_timeout=120)
    assert caught.value.rank == 1, str(caught.value)
    assert str(caught.value).startswith("rank 1 exited with code 1 without reporting an error")


def test_a_silent_non_zero_exit_first_is_blamed_over_the_echo() -> None:
    echo = RankReport("error", "RuntimeError: Connection reset by peer", 1.0, "0F0")
    results: list[Result | None] = [("error", echo), None]
    failure = failure_error(results, (1, 1), [1], None, None)
    assert failure is not None and failure.rank == 1
    failure = failure_error(results, (1, 1), [0], None, None)  # rank 0 ended first: its own
    assert failure is not None and failure.rank == 0
