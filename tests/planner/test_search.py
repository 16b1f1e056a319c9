"""The search: no infeasible pick, the bound never changes the answer, and bad requests."""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.planner import (
    PRESETS,
    ClusterSpec,
    PlanError,
    SearchOptions,
    cluster_from_json,
    parse_shape,
    plan,
    profile_from_cost_json,
    resolve_cluster,
    transformer_profile,
)
from pipeline.planner.memory import HeldTrace
from pipeline.planner.predict import PlanContext, schedule_placement
from schedules import CostModel, loop_placement, v_placement

__all__: list[str] = []

GIB = 2**30
SMALL = transformer_profile(parse_shape("layers=8,hidden=1024,heads=16,vocab=32000,seq=1024"))


def _cluster(memory_gib: float, nodes: int = 1, per_node: int = 4) -> ClusterSpec:
    return replace(PRESETS["a100-80g"], nodes=nodes, devices_per_node=per_node,
                   device_memory=memory_gib * GIB)


@settings(max_examples=12, deadline=None)
@given(st.floats(1.0, 40.0), st.sampled_from([8, 16, 32]), st.sampled_from([1, 2]))
def test_no_pick_exceeds_device_memory(memory_gib: float, batch: int, nodes: int) -> None:
    cluster = _cluster(memory_gib, nodes)
    try:
        result = plan(SMALL, cluster, batch, options=SearchOptions(max_chunks=2))
    except PlanError as error:
        assert "does not fit" in str(error)
        return
    assert all(p.memory.total <= cluster.device_memory for p in result.predictions)
    assert result.best.step_seconds == min(p.step_seconds for p in result.predictions)
    config = result.best.config
    assert config.pp * config.tp * config.dp == cluster.num_devices
    assert config.microbatch_size * config.num_microbatches * config.dp == batch


def test_the_bound_keeps_the_exact_top_and_pareto_front() -> None:
    cluster = _cluster(20.0, nodes=2)
    bounded = plan(SMALL, cluster, 32, options=SearchOptions(top=5, max_chunks=2))
    full = plan(SMALL, cluster, 32, options=SearchOptions(top=100_000, max_chunks=2))
    assert bounded.skipped_by_bound > 0 and full.skipped_by_bound == 0
    assert [p.config for p in bounded.predictions[:5]] == [p.config for p in full.predictions[:5]]
    assert [p.config for p in bounded.pareto()] == [p.config for p in full.pareto()]


def test_pareto_front_is_monotone() -> None:
    result = plan(SMALL, _cluster(20.0), 16, options=SearchOptions(max_chunks=2))
    front = result.pareto()
    assert all(a.step_seconds <= b.step_seconds and a.memory.total > b.memory.total
               for a, b in pairwise(front))


def test_zero_two_and_three_are_never_proposed() -> None:
    result = plan(SMALL, _cluster(80.0), 16, options=SearchOptions(max_chunks=2))
    assert {p.config.zero_stage for p in result.predictions} <= {0, 1}


def test_a_model_too_large_names_the_memory_it_needs() -> None:
    huge = transformer_profile(parse_shape("layers=96,hidden=12288,heads=96,vocab=51200,"
                                           "seq=2048"))
    with pytest.raises(PlanError,
                       match=r"on 4 × 10\.0 GiB devices does not fit.*needs \d+\.\d GiB"):
        plan(huge, _cluster(10.0), 8, options=SearchOptions(max_chunks=2, recompute=False))


def test_an_indivisible_batch_says_what_would_divide() -> None:
    one_layer = profile_from_cost_json({"layers": [{"forward": 1.0, "params": 4}]})
    cluster = _cluster(80.0, per_node=2)
    with pytest.raises(PlanError, match=r"data-parallel size \(devices / \(tp · pp\): 2\) must "
                                        r"divide the global batch 3, and none do"):
        plan(one_layer, cluster, 3)


def test_unknown_cluster_lists_the_presets() -> None:
    with pytest.raises(PlanError, match="a100-80g, h100-80g, a800-80g, local"):
        resolve_cluster("tpu-v5")


def test_cluster_json_overrides_a_preset_and_refuses_unknown_keys() -> None:
    spec = cluster_from_json({"preset": "h100-80g", "nodes": 4})
    assert spec.num_devices == 32 and spec.peak_flops == PRESETS["h100-80g"].peak_flops
    with pytest.raises(PlanError, match="unknown keys"):
        cluster_from_json({"preset": "h100-80g", "gpus": 4})
    with pytest.raises(PlanError, match="lacks"):
        cluster_from_json({"nodes": 1})
    with pytest.raises(PlanError, match="achieved_fraction"):
        cluster_from_json({"preset": "a100-80g", "achieved_fraction": 1.5})


def test_cost_json_models_run_without_tensor_parallel() -> None:
    costs = {"layers": [{"name": f"l{i}", "forward": 0.01, "backward": 0.02,
                         "params": 4e6, "activation": 1e6} for i in range(8)]}
    result = plan(profile_from_cost_json(costs, cost_batch=4), _cluster(80.0), 16,
                  options=SearchOptions(max_chunks=2))
    assert {p.config.tp for p in result.predictions} == {1}
    with pytest.raises(PlanError, match="cannot be split over tensor-parallel ranks"):
        plan(profile_from_cost_json(costs), _cluster(80.0), 16,
             options=SearchOptions(tensor_parallel=(1, 2)))


@pytest.mark.parametrize("name", ["zb-v", "dualpipev", "dualpipev-overlap", "v-half", "v-min"])
def test_v_schedules_are_priced_on_their_v(name: str) -> None:
    # regression: a list of V-shaped names went stale, so dualpipev-overlap, V-Min and V-Half
    # were priced as if their stages looped over the ranks
    assert schedule_placement(name, 4, 2) == v_placement(4)
    assert schedule_placement("interleaved", 4, 2) == loop_placement(4, 2)


@pytest.mark.parametrize("name", ["zb-auto", "zb-v-auto", "interleaved-zb"])
def test_cost_aware_schedules_are_searched_and_never_priced_below_their_real_peak(
        name: str) -> None:
    # zb-v-auto and interleaved-zb were not searched; they are priced at their memory limit
    cluster = _cluster(80.0, per_node=4)
    result = plan(SMALL, cluster, 16, options=SearchOptions(
        schedules=(name,), top=100_000, recompute=False, tensor_parallel=(1,)))
    searched = [p for p in result.predictions if p.config.schedule == name]
    assert searched, f"{name} was never priced"
    context = PlanContext(SMALL, cluster, 16, cluster.precision)
    for prediction in searched:
        config = prediction.config
        costs = context.table(config).costs(config.microbatch_size, True)
        bandwidth, latency = cluster.link(config.pp * config.dp * config.tp)
        model = CostModel(forward=costs.forward.tolist(), backward=costs.input_grad.tolist(),
                          weight=costs.weight_grad.tolist(), comm=latency,
                          activation_bytes=costs.boundary_bytes.tolist(), bandwidth=bandwidth)
        schedule = context.schedule(config, model)
        assert schedule is not None
        real = context.memory(config, HeldTrace.of(schedule))[0].total
        assert real <= prediction.memory.total * (1 + 1e-12), config.label()
