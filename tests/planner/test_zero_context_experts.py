"""ZeRO-2/3 beside context parallelism and ZeRO-3 with expert parallelism in `pipesched plan`:
their collectives (bytes, groups, spans) and each rank's model states against an oracle
written here from the definitions, the search and `--price` holding them, the pruned search
equal to the unpruned one with them, and planted bugs that fail."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from itertools import pairwise
from typing import Any

import numpy as np
import pytest

import pipeline.planner.data_parallel as data_parallel
import pipeline.planner.memory as memory
from pipeline.cli import main
from pipeline.planner import SearchOptions, load_model, plan
from pipeline.planner.bounds import SearchBounds
from pipeline.planner.grid import configurations
from pipeline.planner.predict import PlanConfig, PlanContext
from pipeline.planner.pricing import allgather_seconds, reduce_scatter_seconds
from pipeline.planner.profile import ModelProfile
from pipeline.planner.rank_pricing import placement_of
from pipeline.planner.search import _context
from schedules.analysis.accounting import ParameterBytes, model_state_bytes
from schedules.analysis.zero_exposure import ZeroLayerCosts, zero_exposed
from tests.planner.bound_oracle import Oracle
from tests.planner.test_search_pruning import TOP, _cluster, _differences

__all__: list[str] = []

GQA_SHAPE = ("layers=8,hidden=1024,heads=16,kv_heads=4,vocab=32000,seq=1024,mlp=swiglu,"
             "norm=rmsnorm,bias=none")
MOE_SHAPE = ("layers=6,hidden=512,heads=8,vocab=1000,seq=256,mlp=swiglu,norm=rmsnorm,"
             "bias=none,learned_positions=false,ffn=1024,experts=4,topk=2,expert_ffn=1024")
GQA, MOE = load_model(GQA_SHAPE), load_model(MOE_SHAPE)
CLUSTER = _cluster(40.0, 2)  # 2 nodes of 4: a group of 8 ranks, or 4 ranks 2 apart, crosses
FP32 = 4.0  # bytes of a parameter, of a gradient (the engine's fp32 reduction)


def _config(pp: int, dp: int, zero: int, *, tp: int = 1, cp: int = 1, ep: int = 1,
            batch: int = 16) -> PlanConfig:
    return PlanConfig(pp=pp, tp=tp, dp=dp, schedule="1f1b", chunks=1, microbatch_size=1,
                      num_microbatches=batch // dp, zero_stage=zero, recompute="none",
                      recompute_layers=0, ep=ep, cp=cp)


CASES: list[tuple[ModelProfile, PlanConfig]] = [
    (GQA, _config(2, 2, 2, cp=2, batch=8)),          # dense over dp × cp = 4, 1 apart
    (GQA, _config(2, 1, 3, tp=2, cp=2, batch=8)),    # over cp alone (dp = 1), 2 apart
    (GQA, _config(1, 2, 3, cp=4, batch=8)),          # 8 ranks: across the two nodes
    (GQA, _config(1, 2, 2, cp=4, batch=8)),
    (MOE, _config(2, 4, 3, ep=2)),                   # experts over 2 ranks, 2 apart
    (MOE, _config(1, 8, 3, ep=2)),                   # experts over 4 ranks 2 apart: 2 nodes
    (MOE, _config(2, 4, 3, ep=4)),                   # experts unsharded (a group of one)
    (MOE, _config(2, 4, 2, ep=2)),
]
IDS = [f"{'moe' if model is MOE else 'gqa'}-{config.label().replace(' ', '-')}"
       for model, config in CASES]


def _stage_counts(context: PlanContext, config: PlanConfig) -> list[tuple[float, float, int]]:
    """Per stage, from the model's layers at the planner's cuts: (parameters one tp rank
    holds besides the routed experts, the routed experts' parameters (all E), layers)."""
    layers, cuts = context.model.layers, context.table(config).boundaries
    return [(sum(layer.params(config.tp) for layer in layers[a:b]),
             sum(layer.expert_params for layer in layers[a:b]), b - a)
            for a, b in pairwise(cuts)]


def _groups(config: PlanConfig) -> tuple[tuple[int, int], tuple[int, int]]:
    """(ranks, stride) of the dense shards' group and of the experts': the dp × cp ranks of
    one tp rank (t apart in the rank order ((pp·dp + dp_rank)·cp + cp_rank)·tp + tp_rank),
    and the t · dp · cp / ep holding the same experts, ep apart on average."""
    d = config.dp * config.cp
    return (d, config.tp), (config.tp * d // config.ep, config.ep)


def _split(config: PlanConfig, dense: float, experts: float) -> tuple[float, float]:
    """(dense, a rank's experts): at ep = tp = 1 the experts are sharded like the rest."""
    if config.ep == 1 and config.tp == 1:
        return dense + experts, 0.0
    return dense, experts / config.ep


def expected_exposed(context: PlanContext, config: PlanConfig) -> np.ndarray:
    """Per rank, what ZeRO-2/3 add to the step beyond the simulator's last reductions:
    every layer of a stage (taken as equal) a unit whose parameters are all-gathered before
    each F and B (ZeRO-3) and whose gradients are reduce-scattered after each B, dense over
    the dp × cp group, experts over theirs, on one link (`zero_exposed`, the engine's
    rule); plus, at ZeRO-2, the blocking all-gather of the updated rank after the step."""
    (d, t), (group, stride) = _groups(config)
    costs = context.table(config).costs(config.microbatch_size)
    seconds = np.zeros(config.pp)
    for (dense, experts, n), rank, f, i, w in zip(
            _stage_counts(context, config), placement_of(config), costs.forward,
            costs.input_grad, costs.weight_grad, strict=True):
        dense, mine = _split(config, dense / n, experts / n)
        gather = allgather_seconds(dense * FP32, d, t, CLUSTER)
        reduce = reduce_scatter_seconds(dense * FP32, d, t, CLUSTER)
        if mine and group > 1:
            gather += allgather_seconds(mine * FP32, group, stride, CLUSTER)
            reduce += reduce_scatter_seconds(mine * FP32, group, stride, CLUSTER)
        layer = ZeroLayerCosts(forward=f / n, weight_grad=(i + w) / (2 * n),
                               input_grad=(i + w) / (2 * n),
                               gather=gather if config.zero_stage == 3 else 0.0, reduce=reduce)
        waited = zero_exposed([layer] * n, zero_stage=config.zero_stage,
                              microbatches=config.num_microbatches)
        seconds[rank] += waited.forward + waited.backward
        if config.zero_stage == 2:
            seconds[rank] += allgather_seconds(dense * n * FP32, d, t, CLUSTER) + (
                allgather_seconds(mine * n * FP32, group, stride, CLUSTER) if mine else 0.0)
    return seconds


def expected_last_reductions(context: PlanContext, config: PlanConfig) -> list[float]:
    """Per stage, its gradients reduce-scattered (ZeRO-1, 2, 3 alike) at the end of the last
    backward: dense over dp × cp, experts over their group (the simulator's lane)."""
    (d, t), (group, stride) = _groups(config)
    times = []
    for dense, experts, _ in _stage_counts(context, config):
        dense, mine = _split(config, dense, experts)
        times.append(reduce_scatter_seconds(dense * FP32, d, t, CLUSTER) + (
            reduce_scatter_seconds(mine * FP32, group, stride, CLUSTER) if mine else 0.0))
    return times


def expected_states(context: PlanContext, config: PlanConfig, rank: int
                    ) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer) bytes of `rank`: fp32 weights 4, gradients 4, Adam
    8 a parameter; ZeRO-2 shards gradients and Adam's, ZeRO-3 all three, the dense ones
    over the dp × cp ranks, a rank's 1/ep of the experts over their group's ranks."""
    (d, _), (group, _) = _groups(config)
    z = config.zero_stage
    dense = experts = 0.0
    for (p, x, _), where in zip(_stage_counts(context, config), placement_of(config),
                                strict=True):
        if where == rank:
            p, mine = _split(config, p, x)
            dense, experts = dense + p, experts + mine

    def held(count: float, ranks: int) -> tuple[float, float, float]:
        return (4 * count / (ranks if z >= 3 else 1), 4 * count / (ranks if z >= 2 else 1),
                8 * count / (ranks if z >= 1 else 1))
    return tuple(a + b for a, b in zip(held(dense, d), held(experts, group),
                                       strict=True))  # type: ignore[return-value]


def _problems(model: ModelProfile, config: PlanConfig) -> list[str]:
    """Where the planner's exposed ZeRO seconds, last reductions and model states differ
    from the oracle's (relative 1e-9)."""
    context = _context(model, CLUSTER, config.num_microbatches * config.dp, None,
                       SearchOptions())
    problems = []
    _, exposed, _ = context.update_seconds(config)
    if not np.allclose(exposed, expected_exposed(context, config), rtol=1e-9, atol=0):
        problems.append(f"exposed {exposed} != {expected_exposed(context, config)}")
    reduction = context._reduction(config, context.table(config))
    assert reduction is not None
    if not np.allclose(reduction.time, expected_last_reductions(context, config), rtol=1e-9):
        problems.append(f"reductions {reduction.time}")
    found, rank = context.memory(config, floor=True)
    got = (found.parameters, found.gradients, found.optimizer)
    if not np.allclose(got, expected_states(context, config, rank), rtol=1e-9, atol=0):
        problems.append(f"states {got} != {expected_states(context, config, rank)}")
    return problems


@pytest.mark.parametrize(("model", "config"), CASES, ids=IDS)
def test_collectives_and_states_equal_the_definitions(model: ModelProfile,
                                                      config: PlanConfig) -> None:
    assert _problems(model, config) == []
    context = _context(model, CLUSTER, config.num_microbatches * config.dp, None,
                       SearchOptions())
    assert context.update_seconds(config)[1].max() > 0  # something to compare


def _dp_alone(honest: Callable[..., np.ndarray], cp: int) -> Callable[..., np.ndarray]:
    def planted(*args: Any, dp: int, **kwargs: Any) -> np.ndarray:
        return honest(*args, dp=dp // cp, **kwargs)
    return planted


def _experts_with_dense(honest: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    def planted(params: np.ndarray, *args: Any, stage_experts: Any = None, ep: int = 1,
                **kwargs: Any) -> np.ndarray:
        return honest(params + (0.0 if stage_experts is None else stage_experts / ep), *args,
                      **kwargs)
    return planted


def _experts_over_dp(precision: str, *, expert_parallel: int, data_parallel: int,
                     zero_stage: int) -> ParameterBytes:
    states = model_state_bytes(precision, zero_stage=zero_stage,  # type: ignore[arg-type]
                               data_parallel=data_parallel)
    return ParameterBytes(*(x / expert_parallel for x in
                            (states.parameters, states.gradients, states.optimizer)))


@pytest.mark.parametrize("planted", ["dense over dp alone", "experts over the dense group",
                                     "expert states over all of dp"])
def test_a_planted_bug_fails_the_oracle(planted: str, monkeypatch: pytest.MonkeyPatch) -> None:
    honest = data_parallel.sharded_comm_seconds
    if planted == "dense over dp alone":  # the rule before context parallelism was priced
        model, config = CASES[2]
        monkeypatch.setattr(data_parallel, "sharded_comm_seconds", _dp_alone(honest, config.cp))
    elif planted == "experts over the dense group":  # the rule before ZeRO-3 ep was priced
        model, config = CASES[5]
        monkeypatch.setattr(data_parallel, "sharded_comm_seconds", _experts_with_dense(honest))
    else:
        model, config = CASES[4]
        monkeypatch.setattr(memory, "expert_state_bytes", _experts_over_dp)
    assert _problems(model, config) != []


def test_the_search_and_price_hold_them(capsys: pytest.CaptureFixture[str]) -> None:
    dense = {(c.cp, c.zero_stage) for c in configurations(GQA, CLUSTER, 8, SearchOptions(
        context_parallel=(1, 2, 4), zero_stages=(0, 1, 2, 3), max_chunks=2))}
    assert {(2, 2), (2, 3), (4, 2), (4, 3)} <= dense
    moe = {(c.ep, c.zero_stage) for c in configurations(MOE, CLUSTER, 16, SearchOptions(
        zero_stages=(0, 1, 2, 3), max_chunks=2))}
    assert {(2, 3), (4, 3)} <= moe  # E = 4 experts
    # `--price` names them and prices them as the search does, and prints the engine's flags
    for shape, price, search, zero in (
            (GQA_SHAPE, "pp2,dp2,cp2,1f1b,b1,z2", ["--cp", "2", "--dp", "2"], 2),
            (MOE_SHAPE, "pp2,dp4,ep2,1f1b,b1,z3", ["--ep", "2"], 3)):
        argv = ["plan", "--model", shape, "--cluster", "a100-80g", "--global-batch", "8",
                "--json"]
        assert main([*argv, "--price", price]) == 0
        priced = json.loads(capsys.readouterr().out)
        assert priced["config"]["zero_stage"] == zero and priced["breakdown"]["dp_comm"] > 0
        assert main([*argv, *search, "--pp", "2", "--microbatch-size", "1", "--schedules",
                     "1f1b", "--recompute", "none", "--zero", str(zero)]) == 0
        pick = json.loads(capsys.readouterr().out)["pick"]
        assert pick["config"]["label"] == priced["config"]["label"]
        assert pick["step_seconds"] == priced["step_seconds"]
        assert pick["engine_arguments"]["zero_stage"] == zero
        assert pick["engine_arguments"].get("context_parallel", 1) == pick["config"]["cp"]
        assert pick["engine_arguments"].get("expert_parallel", 1) == pick["config"]["ep"]


SEARCHES = {
    "zero-2-3-context": (GQA, _cluster(6.0, 2), 8, SearchOptions(
        max_chunks=2, context_parallel=(1, 2), zero_stages=(0, 1, 2, 3),
        schedules=("1f1b", "interleaved", "zb-v"))),
    "zero-3-experts": (MOE, _cluster(4.0, 2), 16, SearchOptions(
        max_chunks=2, zero_stages=(0, 1, 2, 3), schedules=("1f1b", "interleaved", "zb-h1"))),
}


@pytest.mark.parametrize("case", sorted(SEARCHES))
def test_pruned_search_equals_the_unpruned_one_with_them(case: str) -> None:
    model, cluster, batch, options = SEARCHES[case]
    pruned = plan(model, cluster, batch, options=replace(options, top=TOP))
    unpruned = plan(model, cluster, batch, options=replace(options, top=TOP, prune=False))
    assert pruned.skipped_by_bound > 0 and unpruned.skipped_by_bound == 0
    new = {(p.config.cp, p.config.ep, p.config.zero_stage) for p in unpruned.predictions
           if p.config.zero_stage >= 2 and (p.config.cp > 1 or p.config.ep > 1)}
    assert {key[2] for key in new} == {2, 3}, new  # all priced (fit) and simulated
    assert _differences(pruned, unpruned) == []


def _bound_problems(case: str) -> tuple[int, list[str]]:
    """The search's time bounds and memory floors of the case's ZeRO-2/3 configurations
    with cp or ep > 1 that differ from the oracle's (`tests/planner/bound_oracle.py`)."""
    model, cluster, batch, options = SEARCHES[case]
    bounds = SearchBounds(_context(model, cluster, batch, None, options))
    oracle = Oracle(_context(model, cluster, batch, None, options))
    problems, compared = [], 0
    for config in configurations(model, cluster, batch, options):
        if config.zero_stage < 2 or (config.cp == 1 and config.ep == 1):
            continue
        if bounds.lower_bound(config) != oracle.bound(config):
            problems.append(f"{config.label()}: bound")
        if bounds.memory_floor(config) != oracle.floor(config):
            problems.append(f"{config.label()}: floor")
        compared += 1
    return compared, problems


@pytest.mark.parametrize("case", sorted(SEARCHES))
def test_floors_and_bounds_equal_their_definitions_with_them(case: str) -> None:
    compared, problems = _bound_problems(case)
    assert problems == [] and compared > 50


@pytest.mark.parametrize("case", sorted(SEARCHES))
def test_a_planted_bug_in_the_bound_is_caught(case: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    honest = data_parallel.sharded_comm_seconds
    monkeypatch.setattr(data_parallel, "sharded_comm_seconds",
                        _dp_alone(honest, 2) if case.endswith("context")
                        else _experts_with_dense(honest))
    assert _bound_problems(case)[1] != []
