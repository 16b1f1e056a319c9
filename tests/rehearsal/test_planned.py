"""A planner configuration as emulated layers: each stage waits what the planner priced."""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.planner import PRESETS, LayerProfile, ModelProfile, PlanConfig, SearchOptions, plan
from pipeline.planner.predict import PlanContext
from pipeline.planner.pricing import layer_split_times, layer_times
from pipeline.rehearsal.emulated import EmulatedCost
from pipeline.rehearsal.planned import planned_costs, planned_rehearsal

__all__: list[str] = []

CLUSTER = replace(PRESETS["a100-80g"], devices_per_node=4, op_overhead=1e-4)


def _model(layers: int = 8) -> ModelProfile:
    """Measured-style layers with fixed parts and a split backward whose W costs more than
    I; the first layer has an input gradient price too (folded into its W when emulated)."""
    return ModelProfile(tuple(LayerProfile(
        name=f"layer{k}", params_replicated=1000 + 10 * k, held_replicated=64 * (k + 1),
        output_bytes=64 * (k + 1), forward_seconds=1e-4 * (1 + k % 3), forward_fixed=2e-4,
        backward_seconds=3e-4, backward_fixed=4e-4, split_seconds=(1e-4, 2e-4),
        split_fixed=(1.5e-4, 2.5e-4)) for k in range(layers)), name="measured")


def _config(schedule: str, pp: int, b: int, m: int, chunks: int = 1, **extra: object
            ) -> PlanConfig:
    values: dict[str, object] = dict(pp=pp, tp=1, dp=1, schedule=schedule, chunks=chunks,
                                     microbatch_size=b, num_microbatches=m, zero_stage=0,
                                     recompute=False)
    values.update(extra)
    return PlanConfig(**values)  # type: ignore[arg-type]


def _stage_sums(costs: tuple[EmulatedCost, ...], boundaries: tuple[int, ...]
                ) -> tuple[np.ndarray, ...]:
    stages = [costs[a:b] for a, b in pairwise(boundaries)]
    return tuple(np.array([sum(getattr(c, name) for c in stage) for stage in stages])
                 for name in ("forward", "input_grad", "weight_grad"))


@settings(max_examples=25, deadline=None)
@given(schedule=st.sampled_from(["1f1b", "gpipe", "zb-h1", "interleaved", "zb-v"]),
       pp=st.sampled_from([2, 4]), b=st.integers(1, 16))
def test_each_stage_waits_what_the_planner_priced_less_its_op_overhead(
        schedule: str, pp: int, b: int) -> None:
    model = _model()
    chunks = 2 if schedule in ("interleaved", "zb-v") else 1
    config = _config(schedule, pp, b, 2 * pp, chunks)
    costs = planned_costs(model, CLUSTER, config)
    table = PlanContext(model, CLUSTER, 64, "fp32").table(config)
    split = schedule in ("zb-h1", "zb-v")
    priced = table.costs(b, split)
    forward, input_grad, weight_grad = _stage_sums(costs, table.boundaries)
    overhead = CLUSTER.op_overhead
    assert forward == pytest.approx(priced.forward - overhead)
    # the backward as a whole: B (fused) or I + W (split), one overhead per op
    ops = 2 if split else 1
    assert input_grad + weight_grad == pytest.approx(priced.total - priced.forward
                                                     - ops * overhead)
    if split:  # stages after the first pay I and W apart, at the planner's prices
        assert input_grad[1:] == pytest.approx(priced.input_grad[1:] - overhead)
        assert weight_grad[1:] == pytest.approx(priced.weight_grad[1:] - overhead)


def test_the_first_layer_has_no_input_gradient_its_price_goes_to_w() -> None:
    model = _model()
    config = _config("zb-h1", 2, 4, 4)
    first = planned_costs(model, CLUSTER, config)[0]
    input_grad, weight_grad = layer_split_times(model.layers[0], CLUSTER, "fp32", 4, 1)
    assert first.input_grad == 0.0
    assert first.weight_grad == pytest.approx(input_grad + weight_grad)


def test_a_fused_backward_costs_the_full_backward_in_the_split_proportion() -> None:
    model = _model()
    b = 3
    layer = planned_costs(model, CLUSTER, _config("1f1b", 2, b, 4))[1]
    _, backward = layer_times(model.layers[1], CLUSTER, "fp32", b, 1)
    input_grad, weight_grad = layer_split_times(model.layers[1], CLUSTER, "fp32", b, 1)
    assert layer.input_grad + layer.weight_grad == pytest.approx(backward)
    assert layer.input_grad / layer.weight_grad == pytest.approx(input_grad / weight_grad)


def test_outputs_carry_the_microbatch_bytes_and_weights_the_parameters() -> None:
    model = _model(4)
    costs = planned_costs(model, CLUSTER, _config("1f1b", 2, 5, 4))
    assert [c.output_elements for c in costs] == [16 * (k + 1) * 5 for k in range(4)]
    assert [c.param_elements for c in costs] == [1000 + 10 * k for k in range(4)]


def test_the_planned_rehearsal_runs_the_planners_configuration() -> None:
    model = _model()
    result = plan(model, replace(CLUSTER, devices_per_node=4), 16, precision="fp32",
                  options=SearchOptions(schedules=("1f1b", "zb-v"), recompute=False,
                                        tensor_parallel=(1,), max_chunks=2))
    prediction = next(p for p in result.predictions if p.config.dp > 1 and p.config.pp > 1)
    config = prediction.config
    rehearsal = planned_rehearsal(prediction, model, CLUSTER, steps=3)
    assert (rehearsal.stages, rehearsal.chunks, rehearsal.microbatches) == (
        config.pp, config.chunks, config.num_microbatches)
    assert (rehearsal.data_parallel, rehearsal.zero_stage, rehearsal.schedule) == (
        config.dp, config.zero_stage, config.schedule)
    assert rehearsal.boundaries == prediction.boundaries and rehearsal.steps == 3
    assert rehearsal.layers == planned_costs(model, CLUSTER, config)


def test_configurations_emulated_layers_cannot_run_are_refused() -> None:
    model = _model()
    with pytest.raises(ValueError, match="tensor_parallel"):
        planned_costs(model, CLUSTER, _config("1f1b", 2, 1, 4, tp=2))
    with pytest.raises(ValueError, match="recompute"):
        planned_costs(model, CLUSTER, _config("1f1b", 2, 1, 4, recompute=True))


def test_a_prediction_for_another_model_is_refused() -> None:
    model = _model()
    result = plan(model, CLUSTER, 8, precision="fp32",
                  options=SearchOptions(schedules=("1f1b",), recompute=False,
                                        tensor_parallel=(1,)))
    with pytest.raises(ValueError, match="boundaries"):
        planned_rehearsal(result.best, _model(6), CLUSTER)
