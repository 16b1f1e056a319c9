"""Our schedules against the reference heuristics and the proven optimum; the never-worse sweep.

    python benchmarks/bench_references.py [--time-limit S] [--sweep] [--quick]

Table: for each case, our makespan, the reference's (the Zero Bubble authors' V greedy
and one-chunk greedy, written from the paper in `schedules.search.authors_v_greedy` /
`schedules.search.authors_greedy`; torch's ScheduleInterleavedZeroBubble order, read from torch;
DeepSeek's DualPipe bubble formula) and the optimum under the same placement and memory
(`zb-optimal`, CP-SAT; "≥ x" when the time limit stopped it first), with our gap in %.

Sweep (--sweep): p in 2..16, m in p..4p, four cost ratios, comm 0 and 0.2, two memory
limits: zb-v-auto against the V greedy (makespan) and zb-auto against the authors' greedy
(their objective: the longest rank span). Prints the cases where ours is worse (there
must be none) and where it is better.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from schedules import (
    CostModel,
    Schedule,
    figures,
    generate_schedule,
    loop_placement,
    search_zb_auto,
    simulate,
    solve_zb_optimal,
    v_placement,
)
from schedules.search.authors_greedy import PaperGreedyKnobs, paper_greedy_order
from schedules.search.authors_v_greedy import VGreedyKnobs, v_greedy_order

__all__: list[str] = []

INF = float("inf")


def makespan(schedule: Schedule, costs: CostModel) -> float:
    return figures(simulate(schedule, costs)).makespan


def span(schedule: Schedule, costs: CostModel) -> float:
    """The Zero Bubble paper's iteration time: the longest rank's first start to last end."""
    timeline = simulate(schedule, costs)
    return max(float(timeline.end[timeline.rank == r].max() - timeline.start[
        timeline.rank == r].min()) for r in range(timeline.num_ranks))


def v_greedy(p: int, m: int, limit: int, costs: CostModel) -> Schedule | None:
    """The paper's V greedy at its best fill setting (by makespan)."""
    forward, backward, weight, delay, _ = costs.resolve(2 * p)
    found = [Schedule("v-greedy", m, v_placement(p), streams)
             for fill in itertools.product((True, False), repeat=2)
             if (streams := v_greedy_order(p, m, limit, forward, backward, weight, delay,
                                           VGreedyKnobs(*fill))) is not None]
    return min(found, key=lambda s: makespan(s, costs), default=None)


def paper_greedy(p: int, m: int, limit: int, costs: CostModel) -> Schedule | None:
    """The authors' one-chunk greedy at its best knob setting (by their span objective)."""
    forward, backward, weight, delay, _ = costs.resolve(p)
    found = [Schedule("paper-greedy", m, loop_placement(p, 1), streams)
             for knobs in itertools.product((True, False), repeat=3)
             if (streams := paper_greedy_order(m, limit, forward, backward, weight, delay,
                                               PaperGreedyKnobs(*knobs))) is not None]
    return min(found, key=lambda s: span(s, costs), default=None)


def torch_zb1p(p: int, m: int) -> Schedule | None:
    """torch's ScheduleInterleavedZeroBubble compute order (v = 2), or None without torch."""
    try:
        from torch.distributed.pipelining import schedules as torch_schedules
        from torch_stand_ins import stand_in_stages, torch_order
    except ImportError:
        return None
    from schedules import from_torch_rows

    instance = torch_schedules.ScheduleInterleavedZeroBubble(stand_in_stages(p, 2), m)
    return from_torch_rows(torch_order(instance, p), name="torch-zb1p", num_microbatches=m)


_SOLVED: dict[tuple[object, ...], str] = {}


def optimum(schedule: Schedule, limit: int, costs: CostModel, seconds: float) -> str:
    """The proven optimum ("≥ bound" if unproven), solved once per problem."""
    if schedule.num_ranks > 8 or schedule.num_microbatches > 16:
        return "-"
    key = (schedule.placement, schedule.num_microbatches, limit, costs)
    if key not in _SOLVED:
        plan = solve_zb_optimal(schedule.num_ranks, schedule.num_microbatches, schedule.chunks,
                                memory_limit=limit, costs=costs, time_limit=seconds,
                                placement=schedule.placement)
        _SOLVED[key] = f"{plan.makespan:g}" if plan.proven else f"≥ {plan.bound:.4g}"
    return _SOLVED[key]


def gap(ours: float, best: str) -> str:
    if best == "-":
        return "-"
    value = float(best.lstrip("≥ "))
    return f"{100 * (ours / value - 1):.1f}" if best[0] != "≥" else \
        f"≤ {100 * (ours / value - 1):.1f}"


def reference_table(seconds: float) -> None:
    print("Makespan (time units) against the reference heuristic and the proven optimum at "
          "the same placement and memory; gap = ours / optimum - 1")
    print()
    print("| schedule | case | ours | reference | reference value | optimum | gap % |")
    print("|---|---|---|---|---|---|---|")
    unit, w2 = CostModel(), CostModel(weight=2.0)
    comm = CostModel(comm=0.2)
    rows: list[tuple[str, str, Callable[[], tuple[Schedule, int, CostModel, str, float]]]] = []
    for p, m, costs, label in ((4, 4, unit, "unit"), (8, 8, unit, "unit"),
                               (4, 8, comm, "comm 0.2"), (16, 32, w2, "W=2")):
        def zbv(p: int = p, m: int = m, costs: CostModel = costs) -> tuple[
                Schedule, int, CostModel, str, float]:
            ours = generate_schedule("zb-v-auto", p, m, memory_limit=2 * p, costs=costs)
            ref = v_greedy(p, m, 2 * p, costs)
            return ours, 2 * p, costs, "V greedy (paper)", makespan(ref, costs) if ref else INF
        rows.append(("zb-v-auto", f"p={p} m={m} {label}, K=2p", zbv))
        rows.append(("zb-v (table)", f"p={p} m={m} {label}, K=2p",
                     lambda p=p, m=m, costs=costs: (generate_schedule("zb-v", p, m), 2 * p, costs,
                                                    "V greedy (paper)",
                                                    makespan(v_greedy(p, m, 2 * p, costs) or
                                                             generate_schedule("zb-v", p, m),
                                                             costs))))
    for p, m, limit in ((8, 16, 16), (4, 12, 4), (6, 12, 8)):
        def auto(p: int = p, m: int = m, limit: int = limit) -> tuple[
                Schedule, int, CostModel, str, float]:
            ours = search_zb_auto(p, m, memory_limit=limit, costs=comm).schedule
            ref = paper_greedy(p, m, limit, comm)
            return ours, limit, comm, "authors' greedy", makespan(ref, comm) if ref else INF
        rows.append(("zb-auto", f"p={p} m={m} comm 0.2, K={limit}", auto))
    zb1p = torch_zb1p(4, 8)
    rows.append(("interleaved-zb (v=2)", "p=4 m=8 unit chunks, K=8",
                 lambda: (generate_schedule("interleaved-zb", 4, 8, memory_limit=8), 8, unit,
                          "torch ZB1P", makespan(zb1p, unit) if zb1p else INF)))
    for name, case, make in rows:
        start = time.perf_counter()
        schedule, limit, costs, ref_name, ref_value = make()
        ours = makespan(schedule, costs)
        best = optimum(schedule, limit, costs, seconds)
        print(f"| {name} | {case} | {ours:g} | {ref_name} | {ref_value:g} | {best} | "
              f"{gap(ours, best)} |  <!-- {time.perf_counter() - start:.1f} s -->", flush=True)
    print()
    for overlap in (1.0, 0.7):
        costs = CostModel(overlap=overlap)
        result = figures(simulate(generate_schedule("dualpipev-overlap", 4, 8), costs))
        idle = max(result.makespan - busy for busy in result.busy)
        formula = (4 - 1) * (overlap * 3 + 2 - 3)  # (PP/2-1)(F&B + B - 3W), PP = 2p
        back_to_back = makespan(generate_schedule("dualpipev", 4, 8), costs)
        print(f"dualpipev-overlap p=4 m=8, F&B = {overlap:g}(F+B): makespan {result.makespan:g} "
              f"(dualpipev back to back {back_to_back:g}); most idle rank {idle:g}, DualPipe's "
              f"formula (p-1)(F&B+B-3W) = {formula:g}")


def sweep(quick: bool) -> None:
    ranks = (2, 4, 8) if quick else (2, 3, 4, 6, 8, 12, 16)
    ratios = ((1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (1.0, 2.0, 1.0), (1.0, 1.0, 2.0))
    worse, better, cases = [], 0, 0
    start = time.perf_counter()
    for p in ranks:
        microbatches = sorted({p, p + 1, 2 * p - 1, 2 * p, 3 * p, 4 * p})
        for m, (f, b, w), comm in itertools.product(microbatches, ratios, (0.0, 0.2)):
            costs = CostModel(forward=f, backward=b, weight=w, comm=comm)
            for limit in (2 * p, 2 * p + 2):
                ref = v_greedy(p, m, limit, costs)
                ours = generate_schedule("zb-v-auto", p, m, memory_limit=limit, costs=costs)
                cases += 1
                if ref is not None:
                    a, r = makespan(ours, costs), makespan(ref, costs)
                    worse += [("zb-v-auto", p, m, (f, b, w, comm), limit, a, r)] * (a > r + 1e-9)
                    better += a < r - 1e-9
            for limit in (p, 2 * p):
                ref = paper_greedy(p, m, limit, costs)
                ours = search_zb_auto(p, m, memory_limit=limit, costs=costs).schedule
                cases += 1
                if ref is not None:
                    a, r = span(ours, costs), span(ref, costs)
                    worse += [("zb-auto", p, m, (f, b, w, comm), limit, a, r)] * (a > r + 1e-9)
                    better += a < r - 1e-9
        print(f"  p={p} done: {cases} cases so far, worse {len(worse)}, better {better} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    print()
    print(f"Sweep: {cases} cases (p in {ranks}, m in p..4p, F:I:W in {ratios}, comm 0/0.2, "
          f"two limits) in {time.perf_counter() - start:.0f} s: ours worse in {len(worse)}, "
          f"strictly better in {better}")
    for row in worse:
        print("  worse:", row)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=20.0,
                        help="seconds per optimum solve (default 20)")
    parser.add_argument("--sweep", action="store_true", help="run the never-worse sweep too")
    parser.add_argument("--quick", action="store_true", help="a smaller sweep (p <= 8)")
    parser.add_argument("--sweep-only", action="store_true", help="skip the table")
    args = parser.parse_args()
    if not args.sweep_only:
        reference_table(args.time_limit)
    if args.sweep or args.sweep_only:
        sweep(args.quick)


if __name__ == "__main__":
    main()
