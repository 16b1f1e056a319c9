"""ZeRO-2 with expert parallelism: a tiny Mixtral at pp2 × dp2 × ep2 (expert states sharded
over the expert-data-parallel group, dense over dp) and at ep1 (replicated experts, whose
gradients are missing where no token reached them) steps as HF does."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.hf_moe_equivalence import moe_step_differences
from tests.support.rank_harness import run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TOLERANCE = 1e-5
"""Relative: loss with the balancing loss, every reduced gradient, every weight."""

RUNS: list[dict[str, Any]] = [
    {"ep": 2, "zero": 2, "steps": 2}, {"ep": 1, "zero": 2, "steps": 2},
    {"ep": 2, "zero": 2, "clip": 0.05, "schedule": "zb-h1"}]


def _check(rank: int, world: int) -> None:
    del rank, world
    torch.set_num_threads(1)
    for run in RUNS:
        found = moe_step_differences("mixtral", pp=2, dp=2, **run)
        for what in ("loss", "grad", "param", "norm"):
            assert found.get(what, 0.0) <= TOLERANCE, (run, what, found.get(what))


def test_mixtral_with_zero_2_and_expert_parallelism_steps_as_hf() -> None:
    run_ranks(_check, 4, timeout=600)
