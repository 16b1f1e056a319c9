"""The search's memory floor and time bound (`SearchBounds`), however they are cached, equal to
the bit a straightforward per-configuration computation from the per-layer prices kept here
(and, where the floor is `PlanContext.memory(floor=True)`, that too)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from pipeline.planner import SearchOptions, load_model
from pipeline.planner.bounds import SearchBounds
from pipeline.planner.grid import configurations
from pipeline.planner.peaks import warm_up_held
from pipeline.planner.predict import PlanConfig, PlanContext
from pipeline.planner.search import _context
from tests.planner.bound_oracle import Oracle
from tests.planner.test_search_pruning import CASES, _cluster

__all__: list[str] = []

MOE = load_model("layers=6,hidden=512,heads=8,vocab=1000,seq=256,mlp=swiglu,norm=rmsnorm,"
                 "bias=none,learned_positions=false,ffn=1024,experts=4,topk=2,expert_ffn=1024,"
                 "tied_embeddings=true")
IDENTITY_CASES = {name: CASES[name] for name in (
    "tp-and-v-schedules", "megatron-2021-step-peak", "tied-embeddings",
    "tied-megatron-2021-engine", "deeper-tight-zero", "overlapped-param-gather",
    "zero-2-3", "context-parallel", "moe-context-parallel")} | {
    "moe-experts": (MOE, _cluster(4.0, 2), 32, SearchOptions(
        max_chunks=2, schedules=("1f1b", "interleaved", "zb-h1", "zb-v"))),
}


def _mismatches(case: str, enough: int = 10**9) -> tuple[int, list[str]]:
    """Configurations compared, and where they differ (the first `enough` differences)."""
    model, cluster, batch, options = IDENTITY_CASES[case]
    context = _context(model, cluster, batch, None, options)
    bounds, oracle = SearchBounds(context), Oracle(_context(model, cluster, batch, None, options))
    reference = _context(model, cluster, batch, None, options)
    problems, compared = [], 0
    for config in configurations(model, cluster, batch, options):
        floor, expected = bounds.memory_floor(config), oracle.floor(config)
        if floor != expected:
            problems.append(f"{config.label()}: floor {floor!r} != {expected!r}")
        if warm_up_held(config.schedule, config.pp, config.num_microbatches,
                        config.chunks) is None:
            defined = reference.memory(config, floor=True)[0].total
            if floor != defined:
                problems.append(f"{config.label()}: floor {floor!r} != memory {defined!r}")
        bound, expected = bounds.lower_bound(config), oracle.bound(config)
        if bound != expected:
            problems.append(f"{config.label()}: bound {bound!r} != {expected!r}")
        compared += 1
        if len(problems) >= enough:
            break
    return compared, problems


@pytest.mark.parametrize("case", sorted(IDENTITY_CASES))
def test_floors_and_bounds_equal_the_per_configuration_definitions(case: str) -> None:
    compared, problems = _mismatches(case)
    assert problems == []
    assert compared > 100


def test_the_cases_cover_what_the_floor_and_bound_depend_on() -> None:
    # every enumerated configuration valid; ZeRO 0 and 1, dp > 1 with several b,
    # recomputation modes, warm-up schedules, tied copies under ZeRO-1, experts at ep > 1,
    # torch DDP at p = 1, uniform layers
    seen: dict[str, set[Any]] = {"zero": set(), "recompute": set(), "ep": set(),
                                 "schedule": set(), "b": set(), "cp": set()}
    for model, cluster, batch, options in IDENTITY_CASES.values():
        for config in configurations(model, cluster, batch, options):
            # made unchecked (`PlanConfig.enumerated`): each passes the checks, equal
            assert PlanConfig(**vars(config)) == config
            seen["zero"].add(config.zero_stage)
            seen["recompute"].add(config.recompute_label().split("-")[0])
            seen["ep"].add(config.ep)
            seen["schedule"].add(config.schedule)
            seen["b"].add(config.microbatch_size)
            seen["cp"].add(config.cp)
    assert seen["zero"] == {0, 1, 2, 3} and seen["ep"] >= {1, 2, 4}
    assert seen["recompute"] >= {"none", "selective", "full", "partial"}
    assert seen["schedule"] >= {"zb-v", "dualpipev", "interleaved", "1f1b", "gpipe"}
    assert len(seen["b"]) >= 4 and seen["cp"] == {1, 2, 4}


@pytest.mark.parametrize("planted", ["tied gradient dropped", "b of the next size",
                                     "cp activations undivided", "cp gathers left out"])
def test_a_planted_bug_in_the_floor_is_caught(planted: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    if planted.startswith("cp"):
        import pipeline.planner.context_parallel as context_parallel

        honest_table = context_parallel.context_table
        if planted == "cp activations undivided":
            def undivided(table: Any, cp: int, stride: int,
                          attention: str = "all-gather") -> Any:
                made = honest_table(table, cp, stride, attention)
                return made if cp == 1 else replace(made, held=made.held + table.held)
            monkeypatch.setattr("pipeline.planner.rank_pricing.context_table", undivided)
        else:
            monkeypatch.setattr(context_parallel, "context_costs",
                                lambda table, costs, batch: replace(
                                    costs, cp_comm=costs.forward * 0.0))
        _, problems = _mismatches("context-parallel", enough=1)
        assert problems
        return
    if planted == "tied gradient dropped":
        monkeypatch.setattr(PlanContext, "tied_grad_bytes", lambda self, config: None)
        case = "tied-embeddings"
    else:
        honest = SearchBounds.memory_floor

        def wrong_b(self: SearchBounds, config: PlanConfig) -> float:
            return honest(self, replace(config, microbatch_size=config.microbatch_size * 2))
        monkeypatch.setattr(SearchBounds, "memory_floor", wrong_b)
        case = "deeper-tight-zero"
    _, problems = _mismatches(case, enough=1)
    assert problems
