"""zb-v-auto: ZB-V under real costs and a memory limit, never behind the paper's V greedy."""

from __future__ import annotations

from schedules.analysis.simulate import CostModel
from schedules.generators.zb_v import zb_v
from schedules.ir.schedule import Schedule, check_count, gc_paused, v_placement
from schedules.search.authors_v_greedy import V_GREEDY_GRID, v_greedy_order
from schedules.search.authors_zbv import ZbvCosts, average_then_median, zbv_orders
from schedules.search.candidates import (
    Orders,
    ScheduleSearch,
    check_memory_limit,
    peak_in_flight,
    pick_fastest,
)
from schedules.search.list_scheduler import (
    CRITICAL_PATH_GRID,
    LARGE_PROBLEM,
    knob_grid,
    list_order,
    try_list_order,
)

__all__ = ["search_zb_v_auto", "zb_v_auto"]

def zb_v_auto(num_ranks: int, num_microbatches: int, *, memory_limit: int | None = None,
              costs: CostModel | None = None) -> Schedule:
    """The fastest ZB-V order found for these costs within `memory_limit` (stage activations
    per rank, default 2p: 1F1B's p microbatches; at least 2, one microbatch in both chunks).

    Candidates: the fixed ZB-V table (torch's order) when it fits, the paper's V greedy in
    its four fill settings each with 0, 1 or 2 extra warm-up rounds (`V_GREEDY_GRID`; on
    large problems 0 only), the authors' own zbv.py plans in its four fill settings
    (`authors_zbv`) fed the true costs and fed as their runtime feeds it (average over a
    rank's chunks, then median over ranks, at least 1; and that without the floor of 1),
    the list scheduler in 32
    settings (8 on large problems) and in its 8 critical-path settings
    (`CRITICAL_PATH_GRID`; 2 on large problems); the shortest simulated makespan wins.
    So it is never slower than those V greedies, the authors' zbv.py as their runtime runs
    it, nor the table under the same memory;
    at unit costs with m = p it halves the table's bubble.
    """
    return search_zb_v_auto(num_ranks, num_microbatches, memory_limit=memory_limit,
                            costs=costs).schedule


@gc_paused
def search_zb_v_auto(num_ranks: int, num_microbatches: int, *, memory_limit: int | None = None,
                     costs: CostModel | None = None) -> ScheduleSearch:
    """`zb_v_auto` with every candidate it compared, fastest first."""
    p = check_count("num_ranks", num_ranks)
    m = check_count("num_microbatches", num_microbatches)
    limit = check_memory_limit(memory_limit, default=2 * p, minimum=2,
                               what="ZB-V needs 2: one microbatch through both chunks")
    costs = costs or CostModel()
    placement = v_placement(p)
    forward, backward, weight, delay, _ = costs.resolve(2 * p)
    orders: Orders = []
    table = zb_v(p, m).streams
    if peak_in_flight(table) <= limit:
        orders.append(("zb-v table", table))
    large = 3 * len(placement) * m > LARGE_PROBLEM  # there, fewer of the extra settings
    for knobs in V_GREEDY_GRID:
        if large and knobs.extra_warmup:
            continue
        streams = v_greedy_order(p, m, limit, forward, backward, weight, delay, knobs)
        if streams is not None:
            orders.append((knobs.label(), streams))
    # The authors' zbv.py plans as their runtime lays them out, fed the true costs and
    # fed as the runtime feeds it (average-then-median, at least 1), and that unclamped
    runtime = average_then_median(p, forward, backward, weight, delay)
    feedings = {"true costs": ZbvCosts(tuple(forward), tuple(backward), tuple(weight),
                                       tuple(delay), costs.comm),
                "runtime's costs": runtime}
    unclamped = average_then_median(p, forward, backward, weight, delay, at_least=0.0)
    if unclamped != runtime:
        feedings["average-then-median costs"] = unclamped
    for feeding, fed in feedings.items():
        orders.extend((f"{label}, {feeding}", streams)
                      for label, streams in zbv_orders(p, m, limit, fed))
    orders.extend((knobs.label(), list_order(placement, m, limit, forward, backward, weight,
                                             delay, knobs))
                  for knobs in knob_grid(len(placement), m))
    for list_knobs in CRITICAL_PATH_GRID[:2] if large else CRITICAL_PATH_GRID:
        found = try_list_order(placement, m, limit, forward, backward, weight, delay,
                               list_knobs)
        if found is not None:
            orders.append((list_knobs.label(), found))
    return pick_fastest("zb-v-auto", m, placement, orders, costs)
