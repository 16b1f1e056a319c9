"""A rank stopped inside a tp collective is named, not the tp partner blocked in it with
(issue 49 item 3: at pp 2 × tp 2, rank 0 SIGSTOPped in a tp layer; rank 3 timed out on its
receive from rank 1, found rank 1 "busy" in 0F1 and named it)."""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeline import LayerSpec, PipelineEngine, PipelineModule, RankFailedError, launch
from pipeline.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from pipeline.supervision.progress import RankState, name_culprit


def test_a_silent_rank_is_named_over_a_busy_rank_that_may_wait_on_it() -> None:
    busy = RankState("train_batch of step 1", "0F1", None, 9)
    stall = name_culprit({1: busy, 2: RankState("train_batch of step 1", None, 1, 9)},
                         [0, 1, 2, 3], 3, 1, 2.0)
    assert stall.culprit == 0, stall
    assert stall.explanation.startswith("rank 0 stopped progressing: it answered no probe")
    assert "rank 1, at the end of the chain of waits 3 -> 1, answers from inside 0F1" in \
        stall.explanation
    everyone = name_culprit({0: busy, 1: busy, 2: busy}, [0, 1, 2, 3], 3, 1, 2.0)
    assert everyone.culprit == 1  # all answer: the busy rank at the end of the waits


class StopsRankZero(nn.Module):
    """SIGSTOPs rank 0 in its second forward, between its tp layers' collectives."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if dist.get_rank() == 0 and self.calls == 2:
            os.kill(os.getpid(), signal.SIGSTOP)
        return x


def _train_pp2_tp2() -> None:
    layers = [LayerSpec(ColumnParallelLinear, 4, 8), LayerSpec(StopsRankZero),
              LayerSpec(RowParallelLinear, 8, 4), LayerSpec(ColumnParallelLinear, 4, 8),
              LayerSpec(RowParallelLinear, 8, 4)]
    module = PipelineModule(layers, num_stages=2, loss_fn=F.mse_loss)
    engine = PipelineEngine(module, num_microbatches=2, tensor_parallel=2, timeout=5)
    for _ in range(2):
        engine.train_batch(torch.zeros(4, 4), torch.zeros(4, 4))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_rank_stopped_inside_a_tp_collective_is_named_not_its_partner() -> None:
    with pytest.raises(RankFailedError) as caught:
        launch(_train_pp2_tp2, 4, timeout=5, join_timeout=120)
    assert caught.value.rank == 0, str(caught.value)
