"""zb-auto: the Zero Bubble paper's automatic schedule, searched over its knobs under real costs."""

from __future__ import annotations

import itertools

from schedules.analysis.simulate import CostModel
from schedules.generators.zb_h1_h2 import zb_h1, zb_h2
from schedules.ir.instructions import Instruction
from schedules.ir.schedule import Schedule, check_count, gc_paused, loop_placement
from schedules.search.authors_greedy import PaperGreedyKnobs, paper_greedy_order
from schedules.search.candidates import ScheduleSearch, peak_in_flight, pick_fastest
from schedules.search.list_scheduler import LIST_KNOB_GRID, list_order
from schedules.search.paper_greedy import GreedyKnobs, greedy_order

__all__ = ["search_zb_auto", "zb_auto"]

KNOB_GRID: tuple[GreedyKnobs, ...] = tuple(
    GreedyKnobs(input_grad_first=first, min_gap_for_w=gap, lookahead=look)
    for first, gap, look in itertools.product((True, False), (0.0, 1.0), (False, True)))
"""The heuristic's variants tried by `zb_auto` (2 × 2 × 2)."""


def zb_auto(num_ranks: int, num_microbatches: int, *, memory_limit: int | None = None,
            costs: CostModel | None = None) -> Schedule:
    """The order with the shortest simulated iteration found for these costs and memory.

    The iteration time is the paper's: the longest rank span (a rank's first op start to
    its last op end), what back-to-back steps cost when the optimizer step needs no global
    barrier; ties go to the shorter makespan, then to less memory.

    `memory_limit` K: microbatches of one stage's activations a rank may hold (F started,
    W not run); default 2p. `costs`: per-stage F, B (input gradient), W and comm, as
    for `simulate` (default: all 1, no comm). Never worse than ZB-H1 when K >= min(p, m),
    nor than ZB-H2 when K >= min(2p - 1, m): both are candidates.
    """
    return search_zb_auto(num_ranks, num_microbatches, memory_limit=memory_limit,
                          costs=costs).schedule


@gc_paused
def search_zb_auto(num_ranks: int, num_microbatches: int, *, memory_limit: int | None = None,
                   costs: CostModel | None = None) -> ScheduleSearch:
    """`zb_auto` with the candidates it compared (for reports and benchmarks)."""
    p = check_count("num_ranks", num_ranks)
    m = check_count("num_microbatches", num_microbatches)
    limit = 2 * p if memory_limit is None else check_count(
        "memory_limit", memory_limit, hint=" (microbatches of one stage's activations a rank "
        "may hold; 1F1B needs p, ZB-H2 2p-1)")
    costs = costs or CostModel()
    forward, backward, weight, delay, _ = costs.resolve(p)
    placement = loop_placement(p, 1)
    # The paper's step list (greedy) under each knob setting, then the handcrafted
    # schedules that fit in the memory limit: the search can only improve on them.
    orders: list[tuple[str, tuple[tuple[Instruction, ...], ...]]] = [
        (knobs.label(), greedy_order(m, limit, forward, backward, weight, delay, knobs))
        for knobs in KNOB_GRID]
    orders.extend((knobs.label(), list_order(placement, m, limit, forward, backward, weight,
                                             delay, knobs))
                  for knobs in LIST_KNOB_GRID if knobs.deepest_forward and knobs.deepest_backward)
    for first, prioritize, greedy in itertools.product((True, False), repeat=3):
        paper = PaperGreedyKnobs(first, prioritize, greedy)
        streams = paper_greedy_order(m, limit, forward, backward, weight, delay, paper)
        if streams is not None:
            orders.append((paper.label(), streams))
    for baseline in (zb_h1, zb_h2):
        streams = baseline(p, m).streams
        if peak_in_flight(streams) <= limit:
            orders.append((baseline.__name__.replace("_", "-"), streams))
    return pick_fastest("zb-auto", m, placement, orders, costs, objective="span")
