"""ZeRO-2 and ZeRO-3 with expert parallelism: a tiny Mixtral from a save_pretrained directory
at pp2 × dp2 × ep2 (expert states, and under ZeRO-3 expert parameters, sharded over the
expert-data-parallel group, dense ones over dp) and at ep1 steps as HF does under 1F1B,
interleaved and ZB-V; ZeRO-3 ep checkpoints load at ZeRO-1 ep2 (and back) as the run that
continued; at pp2 × dp4 × ep2 the expert shards are split over two ranks and still step
as HF does."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from pipeline import launch
from pipeline.parallel.expert_zero3 import ExpertFullyShardedOptimizer
from tests.support.hf_moe_equivalence import moe_step_differences
from tests.support.reshard_cases import Layout, ReshardCase, reshard_differences

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TOLERANCE = 1e-5
"""Relative: loss with the balancing loss, every reduced gradient, every weight."""

ZERO_2: list[dict[str, Any]] = [
    {"ep": 2, "zero": 2, "steps": 2}, {"ep": 1, "zero": 2, "steps": 2},
    {"ep": 2, "zero": 2, "clip": 0.05, "schedule": "zb-h1"}]

ZERO_3: list[dict[str, Any]] = [
    # by parameters: one MoE block on each pipeline rank (uniform puts both on rank 0)
    {"schedule": "1f1b", "partition_method": "parameters"},
    {"schedule": "interleaved", "chunks": 2},
    {"schedule": "zb-v", "chunks": 2},
    {"schedule": "1f1b", "partition_method": "parameters", "reshard_after_forward": False,
     "clip": 0.05}]
"""Each at pp2 × dp2 × ep2, ZeRO-3, two SGD steps."""

CHECKPOINTS = [
    ReshardCase("mixtral", Layout(pp=2, dp=2, ep=2, zero=3), (Layout(pp=2, dp=2, ep=2, zero=1),)),
    ReshardCase("mixtral", Layout(pp=2, dp=2, ep=2, zero=1), (Layout(pp=2, dp=2, ep=2, zero=3),)),
]
"""Adam state saved at one ZeRO stage, loaded at the other."""

WHAT = ("loss", "grad", "param", "norm")


def _zero3_summary(found: dict[str, Any], dp: int, ep: int) -> dict[str, Any]:
    """The differences from HF and what the ZeRO-3 optimizer holds (picklable)."""
    optimizer = found["engine"].optimizer
    summary = {what: found[what] for what in WHAT if what in found}
    summary["type"] = type(optimizer).__name__
    if isinstance(optimizer, ExpertFullyShardedOptimizer):
        summary["dense_ranks"] = optimizer.dense.dp_size
        summary["expert_ranks"] = None if optimizer.experts is None else optimizer.experts.dp_size
        summary["expected_expert_ranks"] = dp // ep
    summary["unit_bytes"] = found["unit_bytes"]
    summary["has_moe_layer"] = any(".experts." in name for name in found["reads"])
    return summary


def _four_ranks(root: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    zero2 = [{what: found[what] for what in WHAT if what in found}
             for found in (moe_step_differences("mixtral", pp=2, dp=2, **run) for run in ZERO_2)]
    zero3 = [_zero3_summary(moe_step_differences("mixtral", pp=2, dp=2, ep=2, zero=3, steps=2,
                                                 **run), dp=2, ep=2)
             for run in ZERO_3]
    checkpoints = [result for case in CHECKPOINTS for result in reshard_differences(case, root)]
    return {"rank": dist.get_rank(), "zero2": zero2, "zero3": zero3, "checkpoints": checkpoints}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One 4-process launch (pp2 × dp2) running every configuration."""
    root = str(tmp_path_factory.mktemp("zero3-ep"))
    return launch(_four_ranks, 4, root, timeout=60, join_timeout=900)


def test_mixtral_with_zero_2_and_expert_parallelism_steps_as_hf(
        four_ranks: list[dict[str, Any]]) -> None:
    for outcome in four_ranks:
        for run, found in zip(ZERO_2, outcome["zero2"]):
            for what, difference in found.items():
                assert difference <= TOLERANCE, (outcome["rank"], run, what, difference)


def _check_zero3(outcome: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    for run, found in zip(runs, outcome["zero3"], strict=True):
        where = (outcome["rank"], run)
        for what in WHAT:
            assert found.get(what, 0.0) <= TOLERANCE, (*where, what, found.get(what))
        assert found["type"] == "ExpertFullyShardedOptimizer", where
        assert found["dense_ranks"] == 2 * found["expected_expert_ranks"], where
        # a pipeline rank holding an MoE block shards its experts over the expert-dp group
        assert found["expert_ranks"] == (found["expected_expert_ranks"]
                                         if found["has_moe_layer"] else None), (where, found)
        assert found["unit_bytes"] == 0, where  # after the step: shards only


def test_mixtral_with_zero_3_and_expert_parallelism_steps_as_hf(
        four_ranks: list[dict[str, Any]]) -> None:
    """1F1B, interleaved, ZB-V and reshard_after_forward=False (with clipping), each rank's
    dense units over dp and expert units over the expert-dp group, freed after the step."""
    for outcome in four_ranks:
        _check_zero3(outcome, ZERO_3)
    # partitioned by parameters, both pipeline ranks hold an MoE block under 1F1B
    assert all(outcome["zero3"][0]["has_moe_layer"] for outcome in four_ranks)


def test_zero_3_expert_checkpoints_load_at_zero_1_and_back(
        four_ranks: list[dict[str, Any]]) -> None:
    for outcome in four_ranks:
        for result in outcome["checkpoints"]:
            assert result["step"] == 1 and result["compared"] > 0, result
            assert max(result["loss"], result["param"]) <= TOLERANCE, (outcome["rank"], result)
    layouts = [result["layout"] for result in four_ranks[0]["checkpoints"]]
    assert layouts == ["pp2-tp1-dp2-ep2-zero1", "pp2-tp1-dp2-ep2-zero3"], layouts


def _eight_ranks() -> dict[str, Any]:
    torch.set_num_threads(1)
    found = moe_step_differences("mixtral", pp=2, dp=4, ep=2, zero=3, steps=2,
                                 partition_method="parameters")
    return {"rank": dist.get_rank(), "zero3": [_zero3_summary(found, dp=4, ep=2)]}


def test_expert_shards_split_over_two_ranks_step_as_hf() -> None:
    """pp2 × dp4 × ep2 (8 ranks): each expert-dp group has two ranks, so every expert unit
    is gathered from two shards (a shard taken from the wrong rank changes the weights)."""
    for outcome in launch(_eight_ranks, 8, timeout=60, join_timeout=900):
        _check_zero3(outcome, [{"schedule": "1f1b", "dp": 4}])
        assert outcome["zero3"][0]["expected_expert_ranks"] == 2
