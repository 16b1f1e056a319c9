"""The engine's two-batch overlap in the planner: an MoE forward outside F&B pairs priced as
two halves (less of the all-to-all exposed), the pruned search still exact under it, and the
flag refused for another engine."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from pipeline.cli import main
from pipeline.planner import PRESETS, PlanConfig, SearchOptions, load_model, plan
from pipeline.planner.launch import LaunchTarget, launch_lines
from pipeline.planner.search import price
from tests.planner.test_moe_planner import FAST, MOE, _small_cluster

__all__: list[str] = []

H100 = PRESETS["h100-80g"]


def _priced(schedule: str, b: int, ep: int, two_batch: bool) -> Any:
    cluster = replace(H100, nodes=2, devices_per_node=8)
    chunks = 2 if schedule.startswith("dualpipev") else 1
    config = PlanConfig(pp=2, tp=1, dp=8, schedule=schedule, chunks=chunks,
                        microbatch_size=b, num_microbatches=64 // 8 // b, zero_stage=0,
                        recompute="none", ep=ep)
    return price(load_model(MOE), cluster, 64, config,
                 options=SearchOptions(two_batch_overlap=two_batch))


@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipev-overlap", "1f1b"])
def test_two_batch_overlap_hides_part_of_the_forwards_all_to_all(schedule: str) -> None:
    """Priced with the engine's two-batch overlap, an MoE configuration whose microbatches
    hold two samples or more runs its forwards outside F&B pairs as two halves: less of the
    all-to-all exposed, a shorter step. One sample (nothing to halve), ep 1 (no all-to-all)
    and a dense model price as without it."""
    plain, halves = (_priced(schedule, 2, 8, flag) for flag in (False, True))
    assert sum(halves.breakdown.values()) == pytest.approx(halves.step_seconds, rel=1e-9)
    assert 0 < halves.breakdown["ep_comm"] < plain.breakdown["ep_comm"]
    assert halves.step_seconds < plain.step_seconds
    for b, ep in ((1, 8), (2, 1)):
        assert _priced(schedule, b, ep, True).step_seconds == \
            _priced(schedule, b, ep, False).step_seconds
    # the engine line of the pick turns it on exactly where it was priced
    assert any("two_batch_overlap=True" in line for line in launch_lines(
        "pipesched", halves.config, 64, 8, target=LaunchTarget(two_batch_overlap=True)))
    assert not any("two_batch_overlap" in line for line in launch_lines(
        "pipesched", replace(halves.config, microbatch_size=1, num_microbatches=8), 64, 8,
        target=LaunchTarget(two_batch_overlap=True)))


def test_two_batch_overlap_keeps_the_pruned_search_exact() -> None:
    """The search's lower bounds hold under two-batch pricing (a two-batch forward is never
    shorter than its compute): the pruned search keeps the unpruned one's top."""
    cluster = _small_cluster(3.0)
    options = {**FAST, "schedules": ("1f1b", "dualpipev-overlap"), "top": 5,
               "two_batch_overlap": True}
    pruned = plan(load_model(MOE), cluster, 16, options=SearchOptions(**options))
    full = plan(load_model(MOE), cluster, 16, options=SearchOptions(**options, prune=False))
    assert [p.config for p in pruned.predictions[:5]] == [p.config for p in full.predictions[:5]]
    assert [p.step_seconds for p in pruned.predictions[:5]] == \
        [p.step_seconds for p in full.predictions[:5]]
    options["two_batch_overlap"] = False
    exposed = {p.config: p.step_seconds
               for p in plan(load_model(MOE), cluster, 16,
                             options=SearchOptions(**options, prune=False)).predictions}
    faster = [p for p in full.predictions if p.step_seconds < exposed[p.config]]
    assert faster and all(p.config.ep > 1 and p.config.microbatch_size >= 2 for p in faster)


def test_plan_refuses_two_batch_overlap_for_another_engine(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--model", MOE, "--cluster", "h100-80g", "--global-batch", "16",
                 "--engine", "deepspeed", "--two-batch-overlap"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--two-batch-overlap is this engine's; deepspeed" in err[0]
