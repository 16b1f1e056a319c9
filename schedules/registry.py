"""Schedules by name: the one table the CLI, the engine and the benchmarks choose from."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass

from schedules.analysis.simulate import CostModel
from schedules.generators.classic import forward_only, gpipe, interleaved_1f1b, one_f_one_b
from schedules.generators.controllable_memory import v_half, v_min
from schedules.generators.dualpipe import dualpipev
from schedules.generators.looped_bfs import looped_bfs
from schedules.generators.zb_h1_h2 import zb_h1, zb_h2
from schedules.generators.zb_v import zb_v
from schedules.ir.errors import ScheduleConfigError
from schedules.ir.limits import check_schedule_size
from schedules.ir.schedule import Schedule, check_count, gc_paused, loop_placement, v_placement
from schedules.passes.lowering import add_optimizer_step, lower
from schedules.search.interleaved_zb import interleaved_zb
from schedules.search.zb_auto import zb_auto
from schedules.search.zb_optimal import zb_optimal
from schedules.search.zb_v_auto import zb_v_auto

__all__ = ["SCHEDULES", "ScheduleSpec", "build_schedule", "generate_schedule"]


@dataclass(frozen=True)
class ScheduleSpec:
    """How to make one named schedule."""

    make: Callable[[int, int, int], Schedule]
    """(p, m, v) -> compute-only schedule."""
    chunks: tuple[int, int | None]
    """Allowed chunks per rank: (min, max); max None means unbounded."""
    default_chunks: int
    summary: str
    plan: Callable[[int, int, int, int | None, CostModel | None], Schedule] | None = None
    """Cost-aware schedules only (zb-auto): (p, m, v, memory_limit, costs) -> schedule;
    None for schedules that depend on p, m and v alone."""
    placement: Callable[[int, int], tuple[int, ...]] = loop_placement
    """(p, v) -> the rank of each stage, as `make` and `plan` place them (without building
    a schedule: the planner prices thousands of configurations; a test checks they agree)."""
    default_limit: Callable[[int, int], int] = lambda p, v: 2 * p
    """Cost-aware schedules: (p, v) -> the memory limit `plan` takes when given None
    ((stage, microbatch) activations per rank; a test checks they agree)."""


def _v_shape(p: int, v: int) -> tuple[int, ...]:
    return v_placement(p)


def _v_when_two(p: int, v: int) -> tuple[int, ...]:
    return v_placement(p) if v == 2 else loop_placement(p, v)


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(lambda p, m, v: gpipe(p, m), (1, 1), 1,
                          "all forwards, then all backwards; m activations per rank"),
    "1f1b": ScheduleSpec(lambda p, m, v: one_f_one_b(p, m), (1, 1), 1,
                         "PipeDream-Flush: warm-up, one-forward-one-backward, cool-down"),
    "interleaved": ScheduleSpec(interleaved_1f1b, (1, None), 2,
                                "Megatron interleaved 1F1B, v chunks per rank in a loop"),
    "forward-only": ScheduleSpec(forward_only, (1, None), 1, "inference: forwards only"),
    "zb-h1": ScheduleSpec(lambda p, m, v: zb_h1(p, m), (1, 1), 1,
                          "Zero Bubble H1: 1F1B's memory, bubble (p-1)(F+B-W)"),
    "zb-h2": ScheduleSpec(lambda p, m, v: zb_h2(p, m), (1, 1), 1,
                          "Zero Bubble H2: 2p-1 microbatches of memory, bubble (p-1)(F+B-2W)"),
    "zb-v": ScheduleSpec(lambda p, m, v: zb_v(p, m), (2, 2), 2,
                         "Zero Bubble V: 2 chunks in a V, no bubble at 1F1B's activation memory "
                         "(2p half-stage activations) if F=B=W",
                         placement=_v_shape),
    "dualpipev": ScheduleSpec(lambda p, m, v: dualpipev(p, m), (2, 2), 2,
                              "DeepSeek DualPipeV: V placement, F of one microbatch with B of "
                              "another; m >= 2p",
                              placement=_v_shape),
    "dualpipev-overlap": ScheduleSpec(
        lambda p, m, v: dualpipev(p, m, overlap=True), (2, 2), 2,
        "DualPipeV with each F&B of the main step one overlapped pair (OVERLAP_B), costed "
        "by the cost model's overlap; m >= 2p",
        placement=_v_shape),
    "looped-bfs": ScheduleSpec(looped_bfs, (1, None), 2,
                               "looped breadth-first: every microbatch through a chunk, then "
                               "the next chunk"),
    "zb-auto": ScheduleSpec(
        lambda p, m, v: zb_auto(p, m), (1, 1), 1,
        "Zero Bubble automatic: the paper's greedy, searched under the costs and a memory "
        "limit (default 2p)",
        plan=lambda p, m, v, limit, costs: zb_auto(p, m, memory_limit=limit, costs=costs)),
    "v-half": ScheduleSpec(lambda p, m, v: v_half(p, m), (2, 2), 2,
                           "controllable memory V-Half: a repeated building block, about half "
                           "of 1F1B's activation memory, about no bubble",
                           placement=_v_shape),
    "v-min": ScheduleSpec(lambda p, m, v: v_min(p, m), (2, 2), 2,
                          "controllable memory V-Min: a repeated building block, about a third "
                          "of 1F1B's activation memory, a small bubble",
                          placement=_v_shape),
    "zb-v-auto": ScheduleSpec(
        lambda p, m, v: zb_v_auto(p, m), (2, 2), 2,
        "Zero Bubble V under the costs and a memory limit (default 2p stage activations): "
        "never behind the paper's V greedy",
        plan=lambda p, m, v, limit, costs: zb_v_auto(p, m, memory_limit=limit, costs=costs),
        placement=_v_shape),
    "interleaved-zb": ScheduleSpec(
        lambda p, m, v: interleaved_zb(p, m, v), (2, None), 2,
        "interleaved zero bubble (torch's ZB1P, any v >= 2) under the costs and a memory "
        "limit (default v*p stage activations)",
        plan=lambda p, m, v, limit, costs: interleaved_zb(p, m, v, memory_limit=limit,
                                                          costs=costs),
        default_limit=lambda p, v: v * p),
    "zb-optimal": ScheduleSpec(
        lambda p, m, v: zb_optimal(p, m, v), (1, None), 1,
        "the minimum makespan under a memory limit (default 2p), proven by CP-SAT within "
        "10 s; p <= 8, m <= 16; needs pip install ortools",
        plan=lambda p, m, v, limit, costs: zb_optimal(p, m, v, memory_limit=limit,
                                                      costs=costs),
        placement=_v_when_two),
}


@gc_paused
def generate_schedule(name: str, num_ranks: int, num_microbatches: int,
                      chunks: int | None = None, *, memory_limit: int | None = None,
                      costs: CostModel | None = None) -> Schedule:
    """The compute-only schedule called `name` (see `SCHEDULES`) for p, m and v.

    `memory_limit` ((stage, microbatch) activations per rank) and `costs` go to the
    cost-aware schedules (zb-auto, zb-v-auto, interleaved-zb, zb-optimal); the others
    ignore `costs` and refuse a memory limit.
    """
    spec = SCHEDULES.get(name)
    if spec is None:
        close = difflib.get_close_matches(str(name), SCHEDULES, n=2)
        hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
        raise ScheduleConfigError(
            f"unknown schedule {name!r}; {hint}choose one of: {', '.join(SCHEDULES)}")
    if costs is not None and not isinstance(costs, CostModel):
        raise ScheduleConfigError(f"costs must be a schedules.CostModel or None, got {costs!r}")
    check_count("num_ranks (pipeline stages P)", num_ranks)
    check_count("num_microbatches", num_microbatches)
    v = spec.default_chunks if chunks is None else check_count("chunks", chunks)
    low, high = spec.chunks
    if v < low or (high is not None and v > high):
        allowed = f"{low}" if low == high else f"{low}..{high if high is not None else ''}"
        raise ScheduleConfigError(
            f"schedule {name!r} takes chunks in {allowed}, got {v}"
            + ("; use 'interleaved' for several chunks per rank" if high == 1 else ""))
    check_schedule_size(num_ranks, num_microbatches, v, lowered=False)  # before building
    if spec.plan is not None:
        return spec.plan(num_ranks, num_microbatches, v, memory_limit, costs)
    if memory_limit is not None:
        tunable = [n for n, other in SCHEDULES.items() if other.plan is not None]
        raise ScheduleConfigError(
            f"schedule {name!r} has a fixed memory footprint and takes no memory limit "
            f"(got {memory_limit}); drop it, or use {' / '.join(tunable)}")
    return spec.make(num_ranks, num_microbatches, v)


@gc_paused
def build_schedule(name: str, num_ranks: int, num_microbatches: int,
                   chunks: int | None = None, *, memory_limit: int | None = None,
                   costs: CostModel | None = None) -> Schedule:
    """`generate_schedule`, then the shared passes: communication, then reduce-grad and step."""
    spec = SCHEDULES.get(name)  # refuse what is too large to lower before generating it
    check_schedule_size(num_ranks, num_microbatches,
                        spec.default_chunks if spec is not None and chunks is None else chunks)
    return add_optimizer_step(lower(generate_schedule(
        name, num_ranks, num_microbatches, chunks, memory_limit=memory_limit, costs=costs)))
