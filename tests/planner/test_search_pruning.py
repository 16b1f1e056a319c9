"""The pruned search (memory floor, time bound, closed-form peaks, shared simulations) gives
exactly the unpruned search's top K and Pareto front; over-aggressive bounds are caught."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest

from pipeline.planner import (
    PRESETS,
    ClusterSpec,
    SearchOptions,
    load_model,
    parse_shape,
    plan,
)
from pipeline.planner.bounds import SearchBounds
from pipeline.planner.predict import PlanContext
from pipeline.planner.search import PlanResult
from pipeline.planner.transformer_layers import transformer_profile

__all__: list[str] = []

GIB = 2**30
SMALL = transformer_profile(parse_shape("layers=8,hidden=1024,heads=16,vocab=32000,seq=1024"))
GQA = transformer_profile(parse_shape("layers=8,hidden=1024,heads=16,kv_heads=4,vocab=32000,"
                                     "seq=1024,mlp=swiglu,norm=rmsnorm,bias=none"))
DEEP = transformer_profile(parse_shape("layers=16,hidden=2048,heads=16,vocab=32000,seq=2048"))
TIED = transformer_profile(parse_shape("layers=8,hidden=1024,heads=16,vocab=32000,seq=1024,"
                                       "tied_embeddings=true"))
MOE = transformer_profile(parse_shape("layers=4,hidden=512,heads=8,kv_heads=4,vocab=1000,"
                                     "seq=1024,mlp=swiglu,norm=rmsnorm,bias=none,experts=4,"
                                     "topk=2,expert_ffn=1024"))
TOP = 4


def _cluster(memory_gib: float, nodes: int, per_node: int = 4, *, cuda: bool = True
             ) -> ClusterSpec:
    """Toy A100s of `memory_gib`; `cuda` False: without the CUDA runtime's NCCL buffers and
    workspaces (`runtime_memory`), which would take most of a device under 1 GiB."""
    return replace(PRESETS["a100-80g"], nodes=nodes, devices_per_node=per_node,
                   device_memory=memory_gib * GIB, compute_capability=80 if cuda else 0)


# (model, cluster, global batch, options): every recomputation mode and ZeRO 0/1 wherever
# dp > 1; memory from roomy to tight (where recomputation and ZeRO decide what fits)
CASES = {
    "roomy-8-devices": (SMALL, _cluster(40.0, 2), 16, SearchOptions(max_chunks=2,
                                                                    searched_max=4)),
    "tight-8-devices": (DEEP, _cluster(4.0, 2), 16, SearchOptions(max_chunks=2)),
    # context parallelism: cp 2 and 4 beside none, sequences of 1024 tokens in 2·cp chunks
    "context-parallel": (GQA, _cluster(6.0, 2), 8, SearchOptions(
        max_chunks=2, context_parallel=(1, 2, 4),
        schedules=("1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev"))),
    "tp-and-v-schedules": (SMALL, _cluster(12.0, 1), 16, SearchOptions(
        max_chunks=2, schedules=("1f1b", "zb-h1", "interleaved", "zb-v", "dualpipev",
                                 "dualpipev-overlap", "v-half", "v-min", "zb-auto"))),
    # Megatron-LM 2021's engine: even layer split, blocking messages, reduction after the flush
    "megatron-2021-engine": (SMALL, _cluster(40.0, 2), 32, SearchOptions(
        schedules=("1f1b", "interleaved"), uniform_layers=True, blocking_p2p=True,
        overlap_grad_reduce=False, step_gradient_bytes=4.0, grad_reduce_bytes=2.0)),
    # its memory: torch DDP's bucket copy at p = 1, fp32 gradient copies at the step only
    # (tight, so that the step's peak decides what fits on some configurations)
    "megatron-2021-step-peak": (DEEP, _cluster(6.0, 2), 32, SearchOptions(
        schedules=("1f1b", "interleaved"), uniform_layers=True, overlap_grad_reduce=False,
        overlap_grad_reduce_unpipelined=True, step_gradient_bytes=4.0,
        grad_reduce_bytes=2.0)),
    # ZeRO-1's parameter gather overlapped with the next forwards: priced by the simulator,
    # none of it in the bound's update
    "overlapped-param-gather": (SMALL, _cluster(12.0, 2), 32, SearchOptions(
        max_chunks=2, overlap_param_gather=True)),
    # a tied embedding: a copy on the head's rank (none on V-shaped schedules) and its
    # all-reduce, in the memory floor and the time bound too
    "tied-embeddings": (TIED, _cluster(0.8, 2, cuda=False), 32, SearchOptions(
        max_chunks=2, schedules=("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v",
                                 "dualpipev"))),
    "tied-megatron-2021-engine": (TIED, _cluster(40.0, 2), 32, SearchOptions(
        schedules=("1f1b", "interleaved"), uniform_layers=True, blocking_p2p=True,
        overlap_grad_reduce=False, step_gradient_bytes=4.0, grad_reduce_bytes=2.0,
        tied_reduce_at_step=False)),
    "deeper-tight-zero": (DEEP, _cluster(10.0, 2), 64, SearchOptions(
        max_chunks=4, tensor_parallel=(1, 2),
        schedules=("gpipe", "1f1b", "interleaved", "looped-bfs", "zb-h2", "zb-v"))),
    # experts with context parallelism: ep carved from dp × cp, each cp rank routing its s/cp
    "moe-context-parallel": (MOE, _cluster(4.0, 2), 8, SearchOptions(
        max_chunks=2, context_parallel=(1, 2), schedules=("1f1b", "zb-h1", "zb-v"))),
    # each expert split over tp too (expert tensor parallelism = tp), sequence parallelism
    "moe-expert-tp": (load_model(
        "layers=4,hidden=512,heads=8,kv_heads=4,vocab=1000,seq=512,mlp=swiglu,norm=rmsnorm,"
        "bias=none,experts=4,topk=2,expert_ffn=1024", sequence_parallel=True),
        _cluster(4.0, 2), 8, SearchOptions(
            max_chunks=2, tensor_parallel=(1, 2), expert_tensor_parallel=True,
            schedules=("1f1b", "zb-h1", "zb-v"))),
    "zero-2-3": (DEEP, _cluster(6.0, 2), 32, SearchOptions(
        max_chunks=2, zero_stages=(0, 1, 2, 3), schedules=("1f1b", "interleaved", "zb-v"))),
}


def _differences(pruned: PlanResult, unpruned: PlanResult) -> list[str]:
    """Where the pruned search's top K and Pareto front differ from the unpruned one's:
    configurations, step times and memory, exactly."""
    def rows(predictions: list) -> list[tuple]:  # type: ignore[type-arg]
        return [(p.config.label(), p.step_seconds, p.memory.total) for p in predictions]

    problems = []
    if rows(pruned.predictions[:TOP]) != rows(unpruned.predictions[:TOP]):
        problems.append(f"top {TOP}: {rows(pruned.predictions[:TOP])} != "
                        f"{rows(unpruned.predictions[:TOP])}")
    if rows(pruned.pareto()) != rows(unpruned.pareto()):
        problems.append(f"front: {rows(pruned.pareto())} != {rows(unpruned.pareto())}")
    return problems


@functools.cache
def _unpruned(case: str) -> PlanResult:
    model, cluster, batch, options = CASES[case]
    return plan(model, cluster, batch, options=replace(options, top=TOP, prune=False))


def _both(case: str) -> tuple[PlanResult, PlanResult]:
    model, cluster, batch, options = CASES[case]
    return plan(model, cluster, batch, options=replace(options, top=TOP)), _unpruned(case)


@pytest.mark.parametrize("case", sorted(CASES))
def test_pruned_search_keeps_the_unpruned_top_and_pareto_front(case: str) -> None:
    pruned, unpruned = _both(case)
    # the pruning did prune, and the reference simulated everything that fits
    assert pruned.skipped_by_bound > 0 and unpruned.skipped_by_bound == 0
    assert len(pruned.predictions) < len(unpruned.predictions)
    assert {p.config.zero_stage for p in unpruned.predictions} == (
        {0, 1, 2, 3} if case == "zero-2-3" else {0, 1})
    assert {p.config.recompute_label().split("-")[0] for p in unpruned.predictions} >= {
        "none", "selective", "full"} or case == "tight-8-devices"
    assert _differences(pruned, unpruned) == []


def test_modes_and_zero_reach_the_front_somewhere() -> None:
    # the comparison means something only if the answers it compares use what is pruned
    labels = {p.config.label() for case in CASES for p in _unpruned(case).pareto()}
    assert any(" rc" in label or " rs" in label for label in labels)
    assert any(" z1" in label for label in labels)


@pytest.mark.parametrize("planted", ["time bound 3% high", "memory floor 40% high"])
def test_an_over_aggressive_bound_makes_the_comparison_fail(
        planted: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if planted.startswith("time"):
        honest_bound = SearchBounds.lower_bound
        monkeypatch.setattr(SearchBounds, "lower_bound",
                            lambda self, config: honest_bound(self, config) * 1.03)
    else:
        honest_floor = SearchBounds.memory_floor
        monkeypatch.setattr(SearchBounds, "memory_floor",
                            lambda self, config: honest_floor(self, config) * 1.4)
    assert any(_differences(*_both(case)) for case in CASES)


@pytest.mark.parametrize("case", ["deeper-tight-zero", "tied-embeddings"])
def test_the_memory_floor_is_the_floor_memory_and_below_the_exact_memory(case: str) -> None:
    # the search's floor is PlanContext.memory(floor=True) or above it (zb-v, dualpipev:
    # their first release) and under every configuration's exact memory (a schedule's trace
    # or closed form)
    from pipeline.planner.grid import configurations

    model, cluster, batch, options = CASES[case]
    context = PlanContext(model, cluster, batch, cluster.precision)
    bounds = SearchBounds(context)
    checked = 0
    for config in configurations(model, cluster, batch, options):
        floor = bounds.memory_floor(config)
        assert floor >= context.memory(config, floor=True)[0].total * (1 - 1e-12)
        trace = context.held_trace(config)
        if trace is not None:
            assert floor <= context.memory(config, trace)[0].total * (1 + 1e-12)
            checked += 1
    assert checked > 100


def test_closed_form_memory_equals_the_traced_memory_in_a_search() -> None:
    from pipeline.planner.grid import configurations

    model, cluster, batch, options = CASES["deeper-tight-zero"]
    closed = PlanContext(model, cluster, batch, cluster.precision)
    traced = PlanContext(model, cluster, batch, cluster.precision, closed_forms=False)
    compared = 0
    for config in configurations(model, cluster, batch, options):
        if config.schedule in ("gpipe", "1f1b", "looped-bfs", "zb-h2"):
            fast, slow = closed.held_trace(config), traced.held_trace(config)
            assert fast is not None and slow is not None
            assert closed.memory(config, fast)[0].total == pytest.approx(
                traced.memory(config, slow)[0].total, rel=1e-12)
            compared += 1
    assert compared > 100


def test_the_moe_cases_compare_cp_with_ep_and_expert_tp_points() -> None:
    found = _unpruned("moe-context-parallel").predictions
    assert any(p.config.cp > 1 and p.config.ep > p.config.dp for p in found)
    assert any(p.config.tp > 1 and p.config.ep > 1
               for p in _unpruned("moe-expert-tp").predictions)
