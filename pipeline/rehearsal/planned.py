"""A planner configuration rehearsed on emulated devices: the planner's per-layer prices at
the configuration's microbatch size as `EmulatedCost`s, and the `RehearsalSpec` that runs them.

The emulated layers then wait exactly what the planner charged for each layer's F, I and W,
so a measured step differs from the prediction only by what the planner models of the
runtime (its per-op overhead, P2P, the data-parallel reduction, the optimizer step) and by
the schedule's real timing. One microbatch is one input row (`pipeline.rehearsal.rehearse` feeds
`torch.zeros(m, 1)`): a layer's output per row is its output bytes for `microbatch_size`
samples, so both the P2P message and the activation it holds for the backward have the
planner's size. An emulated layer holds its output, so activation memory matches the
planner's only for profiles whose layers hold what they output (`held == output_bytes`).
"""

from __future__ import annotations

from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.predict import PlanConfig, Prediction, is_cost_aware
from pipeline.planner.pricing import layer_split_times, layer_times
from pipeline.planner.profile import ModelProfile
from pipeline.rehearsal.emulated import BYTES_PER_ELEMENT, EmulatedCost
from pipeline.rehearsal.rehearse import RehearsalSpec

__all__ = ["planned_costs", "planned_rehearsal"]


def _check_emulable(config: PlanConfig) -> None:
    if config.tp != 1:
        raise ValueError(f"{config.label()}: emulated layers have no tensor-parallel split; "
                         f"plan with SearchOptions(tensor_parallel=(1,))")
    if config.recomputes:
        raise ValueError(f"{config.label()}: emulated layers are not rehearsed with "
                         f"recomputation; plan with SearchOptions(recompute=False)")


def _split_backward(config: PlanConfig, schedule_splits: bool | None) -> bool:
    if schedule_splits is not None:
        return schedule_splits
    if is_cost_aware(config.schedule):
        return True  # planned on the costs, and they always split (as the planner prices it)
    from schedules import Kind, generate_schedule

    schedule = generate_schedule(config.schedule, config.pp, config.num_microbatches,
                                 config.chunks)
    return any(op.kind is Kind.I for stream in schedule.streams for op in stream)


def planned_costs(model: ModelProfile, cluster: ClusterSpec, config: PlanConfig, *,
                  precision: str | None = None, split: bool | None = None
                  ) -> tuple[EmulatedCost, ...]:
    """Each layer's F, I and W seconds as the planner prices them for one microbatch of
    `config.microbatch_size` samples (tp = 1), its output bytes for that microbatch and its
    parameters.

    A fused backward (B = I + W) costs the layer's full backward (`pricing.layer_times`),
    divided between I and W in the proportion of its split prices; a split one (`split`, or
    None: whether the configuration's schedule has I ops) costs its own I and W
    (`pricing.layer_split_times`), as `StageTable.costs` prices them. The planner adds its
    per-op overhead once per stage op on top: that is the engine's real host work, not
    emulated. The first layer's input is data, so its I never runs: its I seconds go to its
    W (the stage's backward keeps its price).
    """
    _check_emulable(config)
    precision = precision or cluster.precision
    b = config.microbatch_size
    splits = _split_backward(config, split)
    costs = []
    for index, layer in enumerate(model.layers):
        forward, backward = layer_times(layer, cluster, precision, b, 1)
        input_grad, weight_grad = layer_split_times(layer, cluster, precision, b, 1)
        if not splits:
            both = input_grad + weight_grad
            share = input_grad / both if both > 0 else 0.5
            input_grad, weight_grad = backward * share, backward * (1.0 - share)
        if index == 0:
            input_grad, weight_grad = 0.0, input_grad + weight_grad
        costs.append(EmulatedCost(
            forward=forward, input_grad=input_grad, weight_grad=weight_grad,
            output_elements=max(1, round(layer.output_bytes * b / BYTES_PER_ELEMENT)),
            param_elements=max(1, round(layer.params(1)))))
    return tuple(costs)


def planned_rehearsal(prediction: Prediction, model: ModelProfile, cluster: ClusterSpec, *,
                      precision: str | None = None, steps: int = 5, warmup: int = 1
                      ) -> RehearsalSpec:
    """The rehearsal that runs `prediction`'s configuration over emulated layers priced as the
    planner priced them, cut where the planner cut (`prediction.boundaries`)."""
    config = prediction.config
    _check_emulable(config)
    if len(prediction.boundaries) != config.pp * config.chunks + 1 or \
            prediction.boundaries[-1] != len(model.layers):
        raise ValueError(f"{config.label()}: boundaries {prediction.boundaries} do not cut "
                         f"{len(model.layers)} layers into {config.pp * config.chunks} stages; "
                         f"give the prediction the planner made for this model")
    return RehearsalSpec(layers=planned_costs(model, cluster, config, precision=precision),
                         boundaries=tuple(prediction.boundaries), schedule=config.schedule,
                         stages=config.pp, chunks=config.chunks,
                         microbatches=config.num_microbatches, data_parallel=config.dp,
                         zero_stage=config.zero_stage, steps=steps, warmup=warmup)
