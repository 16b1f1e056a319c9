"""ZeRO-2 / 3 on emulated devices with a virtual clock wait exactly the time the rule
(`schedules.analysis.zero_exposure`) predicts: the engine overlaps and exposes its gathers and
reduce-scatters as the rule says, with and without prefetch and `reshard_after_forward`."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pipeline import PipelineEngine, PipelineModule
from pipeline.errors import PipelineConfigError
from pipeline.parallel.zero2 import GradShardedOptimizer
from pipeline.rehearsal.emulated import EmulatedCost, emulated_layers, emulated_loss
from pipeline.rehearsal.emulated_zero import EmulatedLinkCosts, EmulatedZeroCollectives, layer_costs
from schedules.analysis.zero_exposure import zero_exposed
from tests.rehearsal.test_emulated_tp import VirtualClock
from tests.support.rank_harness import run_ranks

LAYERS, PARAMS, M, ROWS = 3, 64, 3, 2
COST = EmulatedCost(forward=1.0, input_grad=1.5, weight_grad=2.0, output_elements=4,
                    param_elements=PARAMS)
CONFIGS: list[dict[str, Any]] = [
    {"zero_stage": 2},
    {"zero_stage": 3},
    {"zero_stage": 3, "prefetch_next_unit": False},
    {"zero_stage": 3, "reshard_after_forward": False},
    {"zero_stage": 3, "reshard_after_forward": False, "prefetch_next_unit": False},
]
HEAVY_FORWARD = EmulatedCost(forward=8.0, input_grad=1.0, weight_grad=1.0, output_elements=4,
                             param_elements=PARAMS)
CASES = [(COST, EmulatedLinkCosts(byte_seconds=1e-3, latency=0.05)),  # gathers < compute
         (COST, EmulatedLinkCosts(byte_seconds=1.2e-2, latency=0.1)),  # gathers > compute
         # a reduction > two layers' backward: the third waits for the first (the window of
         # two in flight), the forward after catches the link up
         (HEAVY_FORWARD, EmulatedLinkCosts(byte_seconds=3.83e-2, latency=0.1))]


def _run(cost: EmulatedCost, link: EmulatedLinkCosts, options: dict[str, Any],
         steps: int = 2) -> tuple[float, float]:
    """(virtual seconds of the last step, of its compute alone)."""
    clock = VirtualClock()
    module = PipelineModule(emulated_layers([cost] * LAYERS, clock), num_stages=1,
                            loss_fn=emulated_loss, base_seed=None)
    engine = PipelineEngine(module, schedule="1f1b", num_microbatches=M, data_parallel=2,
                            timeout=60, bucket_mb=PARAMS * 4 / 2**20,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.0), **options)
    try:
        assert isinstance(engine.optimizer, GradShardedOptimizer)
        engine.optimizer.use_collectives(EmulatedZeroCollectives(link, clock))
        x = torch.zeros(M * ROWS, 1)
        for _ in range(steps):
            start = clock.time
            engine.train_batch(x, x)
    finally:
        engine.stop_watchdog()
    compute = M * (LAYERS * (cost.forward + cost.weight_grad)
                   + (LAYERS - 1) * cost.input_grad)
    return clock.time - start, compute


def _predicted(cost: EmulatedCost, link: EmulatedLinkCosts, options: dict[str, Any]
               ) -> float:
    layers = [layer_costs(cost, link, 2, first=u == 0) for u in range(LAYERS)]
    zero = options["zero_stage"]
    step_gather = [link.ring(PARAMS * 4, 2)] * LAYERS if zero == 2 else []
    return zero_exposed(layers, zero_stage=zero, microbatches=M,
                        prefetch=options.get("prefetch_next_unit", True),
                        reshard_after_forward=options.get("reshard_after_forward", True),
                        step_gather=step_gather).total


def _engine_follows_the_rule(rank: int, size: int) -> None:
    for cost, link in CASES:
        for options in CONFIGS:
            step, compute = _run(cost, link, options)
            assert step - compute == pytest.approx(_predicted(cost, link, options),
                                                   rel=1e-9), (cost, link, options)


def _planted(rank: int, size: int, bug: str) -> None:
    (cost, link), options = CASES[1], {"zero_stage": 3}
    if bug == "no prefetch":  # the engine prefetches nothing, priced as prefetching
        step, compute = _run(cost, link, {**options, "prefetch_next_unit": False})
    else:  # every reduce-scatter waited for as soon as launched
        window = GradShardedOptimizer.MAX_IN_FLIGHT
        GradShardedOptimizer.MAX_IN_FLIGHT = 0
        try:
            step, compute = _run(cost, link, options)
        finally:
            GradShardedOptimizer.MAX_IN_FLIGHT = window
    assert step - compute != pytest.approx(_predicted(cost, link, options), rel=1e-3)


@pytest.mark.multiprocess
def test_zero_exposure_is_the_rules_on_a_virtual_clock() -> None:
    run_ranks(_engine_follows_the_rule, 2, timeout=300)


@pytest.mark.multiprocess
@pytest.mark.parametrize("bug", ["no prefetch", "reduction waited at once"])
def test_a_planted_schedule_bug_misses_the_rule(bug: str) -> None:
    run_ranks(_planted, 2, bug, timeout=200)


def test_bad_link_costs_are_refused_by_name() -> None:
    with pytest.raises(PipelineConfigError, match="emulated link latency must be a finite"):
        EmulatedLinkCosts(byte_seconds=1.0, latency=-1.0)
