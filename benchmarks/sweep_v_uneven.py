"""zb-v-auto against the Zero Bubble authors' V greedy on uneven per-chunk costs (issues 22, 34).

Sweep: p in 2..8, m in p..3p, per-chunk (stage) F, I, W drawn uniformly from the integers
1..6 (seeded), memory limits 2p (the authors' runtime default, max_mem = 2p f_mem) and
2p + 2, comm 0 and 1: 308 cases. (At K = p zbv.py always stops on an assertion: its
warm-up needs more; `--limits p,2p` shows it.) For each case zb-v-auto is simulated
against three plans under the same true costs:

- zbv.py, runtime: the authors' `zbv.py` planned on the costs their runtime feeds it
  (`avg_then_mid`: each rank's mean over its two chunks, the median over ranks, at least
  1; the delay at least 1), f_mem 1, b_mem 0, w_mem -1, max_mem K (this package's count
  of chunk activations). With `--reference PATH` (or `ZBV_REFERENCE=PATH`) to a checkout's
  `megatron/core/pipeline_parallel/zerobubble/scheduler/zbv.py`, the authors' own code is
  run (its one import of their graph module stubbed); without it, our reimplementation
  (`schedules.search.authors_zbv`), and with it both are run and every plan compared.
- zbv.py, true costs: the same algorithm fed each chunk's own cost and each edge's delay.
  The original takes one number per kind, so this column is always our reimplementation,
  which reads the cost of the op at hand where the original reads its one number.
- our V greedy (`schedules.search.authors_v_greedy`, the algorithm with our departures),
  best of its four fill settings with 0 to 3 extra warm-up rounds.

The table counts the cases where zb-v-auto is behind, level or ahead of each, and where
the plan does not exist (zbv.py stops on an assertion). There must be no case behind.

    PYTHONPATH=$PWD python benchmarks/sweep_v_uneven.py [--max-ranks 8] [--seed 0] \\
        [--limits 2p,2p+2] [--reference /path/to/zbv.py]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import os
import random
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from schedules import (
    CostModel,
    Instruction,
    Kind,
    Schedule,
    figures,
    simulate,
    v_placement,
    zb_v_auto,
)
from schedules.search.authors_v_greedy import VGreedyKnobs, v_greedy_order
from schedules.search.authors_zbv import ZbvCosts, average_then_median, zbv_order

__all__: list[str] = []

Streams = tuple[tuple[Instruction, ...], ...]
_GRAPH = "megatron.core.pipeline_parallel.zerobubble.scheduler.graph"


def load_reference(path: str) -> Callable[[int, int, int, ZbvCosts], Streams | None]:
    """The authors' zbv.py at `path` as a planner: (p, m, K, even costs) -> streams."""
    parts = _GRAPH.split(".")
    for depth in range(1, len(parts) + 1):  # their one import, of node types only
        sys.modules.setdefault(".".join(parts[:depth]), types.ModuleType(".".join(parts[:depth])))
    graph: Any = sys.modules[_GRAPH]
    graph.ScheduledNode = lambda **fields: types.SimpleNamespace(**fields)
    graph.F, graph.B, graph.W, graph.FuncType = "F", "B", "W", None
    namespace: dict[str, Any] = {}
    exec(compile(Path(path).read_text(), path, "exec"), namespace)
    kinds = {"F": Kind.F, "B": Kind.I, "W": Kind.W}

    def plan(p: int, m: int, limit: int, costs: ZbvCosts) -> Streams | None:
        planner = namespace["PipelineGraph"](p, m, costs.forward[0], costs.backward[0],
                                             costs.weight[0], costs.comm, 1, 0, -1,
                                             max_mem=limit)
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # it prints a line per plan
                order = planner.create_schedule(types.SimpleNamespace(max_chunks=2,
                                                                      n_stages=p))
        except AssertionError:
            return None
        return tuple(tuple(Instruction(kinds[node.type], node.stage if node.chunk == 0
                                       else 2 * p - 1 - node.stage, node.microbatch)
                           for node in rank) for rank in order)

    return plan


def makespan(p: int, m: int, streams: Streams | None, costs: CostModel) -> float | None:
    if streams is None:
        return None
    return figures(simulate(Schedule("plan", m, v_placement(p), streams), costs)).makespan


def greedy_makespan(p: int, m: int, limit: int, costs: CostModel) -> float | None:
    """Our V greedy's best makespan over its fill settings and 0 to 3 extra warm-up rounds,
    None if it finds no order."""
    forward, backward, weight, delay, _ = costs.resolve(2 * p)
    found = [makespan(p, m, v_greedy_order(p, m, limit, forward, backward, weight, delay,
                                           VGreedyKnobs(fill_i, fill_f, extra)), costs)
             for fill_i, fill_f, extra in itertools.product((True, False), (True, False),
                                                             range(4))]
    return min((x for x in found if x is not None), default=None)


def _limit(form: str, p: int) -> int:
    """A limit written in p: "p", "2p", "2p+2", "8"."""
    factor, _, extra = form.partition("+")
    value = (int(factor[:-1] or 1) * p) if factor.endswith("p") else int(factor)
    return value + (int(extra) if extra else 0)


COLUMNS = ("zbv.py, runtime", "zbv.py, true costs", "our V greedy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-ranks", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limits", default="2p,2p+2",
                        help="memory limits per case, in p (e.g. p,2p or 2p,2p+2)")
    parser.add_argument("--reference", default=os.environ.get("ZBV_REFERENCE"),
                        help="path to the authors' zbv.py (default: $ZBV_REFERENCE)")
    args = parser.parse_args()
    reference = load_reference(args.reference) if args.reference else None
    rng = random.Random(args.seed)
    limit_forms = [form.strip() for form in args.limits.split(",")]
    # per column, per p: [behind, level, ahead, no plan]
    tally: dict[str, dict[int, list[int]]] = {column: {} for column in COLUMNS}
    worst = {column: 0.0 for column in COLUMNS}
    gain = {column: 0.0 for column in COLUMNS}
    behind: list[str] = []
    cases = mismatched = 0
    for p in range(2, args.max_ranks + 1):
        limits = sorted({max(2, _limit(form, p)) for form in limit_forms})
        for m, limit, comm in itertools.product(range(p, 3 * p + 1), limits, (0, 1)):
            forward, backward, weight = ([float(rng.randint(1, 6)) for _ in range(2 * p)]
                                         for _ in range(3))
            costs = CostModel(forward=forward, backward=backward, weight=weight, comm=comm)
            _, _, _, delay, _ = costs.resolve(2 * p)
            cases += 1
            ours = figures(simulate(zb_v_auto(p, m, memory_limit=limit, costs=costs),
                                    costs)).makespan
            runtime = average_then_median(p, forward, backward, weight, delay)
            plan = zbv_order(p, m, limit, runtime)
            if reference is not None:
                original = reference(p, m, limit, runtime)
                mismatched += original != plan
                plan = original
            true_costs = ZbvCosts(tuple(forward), tuple(backward), tuple(weight),
                                  tuple(delay), float(comm))
            theirs = {"zbv.py, runtime": makespan(p, m, plan, costs),
                      "zbv.py, true costs": makespan(p, m, zbv_order(p, m, limit, true_costs),
                                                     costs),
                      "our V greedy": greedy_makespan(p, m, limit, costs)}
            for column, value in theirs.items():
                row = tally[column].setdefault(p, [0, 0, 0, 0])
                if value is None:
                    row[3] += 1
                    continue
                difference = (ours - value) / value
                row[0 if difference > 1e-9 else 1 if difference >= -1e-9 else 2] += 1
                worst[column] = max(worst[column], difference)
                gain[column] = min(gain[column], difference)
                if difference > 1e-9:
                    behind.append(f"{column}: p={p} m={m} limit={limit} comm={comm}: "
                                  f"{ours:g} vs {value:g}")
    source = f"the authors' zbv.py ({args.reference})" if reference else \
        "our reimplementation (no --reference given)"
    print(f"zbv.py, runtime: {source}\n")
    print("| p | " + " | ".join(f"{c}: behind / level / ahead / no plan" for c in COLUMNS)
          + " |")
    print("|---|" + "---|" * len(COLUMNS))
    for p in sorted(tally[COLUMNS[0]]):
        print(f"| {p} | " + " | ".join(" / ".join(map(str, tally[c][p])) for c in COLUMNS)
              + " |")
    print(f"\n{cases} cases")
    for column in COLUMNS:
        counts = [sum(row[k] for row in tally[column].values()) for k in range(4)]
        print(f"{column}: behind {counts[0]}, level {counts[1]}, ahead {counts[2]}, no plan "
              f"{counts[3]}; worst {100 * worst[column]:+.1f}%, best {100 * gain[column]:+.1f}%")
    if reference is not None:
        print(f"our reimplementation's plan differs from zbv.py's in {mismatched} of {cases}")
    for line in behind:
        print("behind:", line)


if __name__ == "__main__":
    main()
