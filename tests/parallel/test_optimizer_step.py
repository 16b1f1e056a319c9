"""STEP's vote and its step apart: the vote answers alike on every rank and carries riders;
the step acts on that answer (fp16's scaler takes it instead of voting again)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from pipeline.parallel.optimizer_step import OptimizerStep, ReplicatedGrads
from pipeline.parallel.precision import DynamicLossScaler
from tests.support.rank_harness import run_ranks


def _step_on(rank: int, bad: bool, scaler: DynamicLossScaler | None
             ) -> tuple[OptimizerStep, nn.Parameter]:
    weight = nn.Parameter(torch.ones(3))
    weight.grad = torch.full((3,), 1.0 if scaler is None else scaler.scale)
    if bad:
        weight.grad[rank % 3] = float("nan")
    optimizer = torch.optim.SGD([weight], lr=0.5)
    return OptimizerStep(lambda: optimizer, ReplicatedGrads([weight], None, 0), scaler=scaler,
                         finite_group=dist.group.WORLD), weight


def _check_vote_then_step(rank: int, world_size: int) -> None:
    for bad_rank in (None, world_size - 1):
        step, weight = _step_on(rank, rank == bad_rank, None)
        riders = torch.tensor([float(rank + 1)], dtype=torch.float64)
        # oracle from the definition: some rank holds a NaN; riders sum 1 + 2 + ... + world
        assert step.vote(riders) == (bad_rank is not None), (rank, bad_rank)
        assert riders.item() == world_size * (world_size + 1) / 2
        step()
        assert step.skipped == step.nonfinite == (bad_rank is not None)
        expected = torch.ones(3) if bad_rank is not None else torch.full((3,), 0.5)
        assert torch.equal(weight.detach(), expected), (rank, bad_rank, weight)


def _check_fp16_takes_the_vote(rank: int, world_size: int) -> None:
    scaler = DynamicLossScaler(dist.group.WORLD, init_scale=2.0**10)
    step, weight = _step_on(rank, rank == 0, scaler)

    def second_vote(grads: object) -> bool:
        raise AssertionError("the scaler voted again: STEP's vote already answered")
    scaler.found_overflow = second_vote  # type: ignore[method-assign]
    assert step.vote()
    step()
    # an overflow under fp16 is the scaler's business, not a non-finite error
    assert step.skipped and not step.nonfinite
    assert scaler.scale == 2.0**9 and torch.equal(weight.detach(), torch.ones(3))


def test_the_vote_answers_alike_and_the_step_follows_it() -> None:
    run_ranks(_check_vote_then_step, 3)


def test_fp16_steps_on_the_vote_without_a_second_collective() -> None:
    run_ranks(_check_fp16_takes_the_vote, 2)
