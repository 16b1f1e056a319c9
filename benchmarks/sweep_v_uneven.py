"""zb-v-auto against the authors' V greedy on uneven per-chunk costs and small m (issue 22).

Sweep: p in 2..8, m in p..3p, per-chunk (stage) F, I, W drawn uniformly from the integers
1..6 (seeded), memory limits p and 2p (at least 2, ZB-V's minimum). For each case the V
greedy (`schedules.search.authors_v_greedy`, written from the paper; its best of four fill
settings, each with 0 to 3 warm-up rounds past its time rule: a wider set than the one
zb-v-auto tries) and zb-v-auto are simulated under the same costs; the table counts the
cases where ours is behind, level or ahead, the worst and best relative difference, and
the cases where the greedy finds no order within the limit. There must be no case behind.

    PYTHONPATH=$PWD python benchmarks/sweep_v_uneven.py [--max-ranks 8] [--seed 0]
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from schedules import CostModel, Schedule, figures, simulate, v_placement, zb_v_auto
from schedules.search.authors_v_greedy import VGreedyKnobs, v_greedy_order

__all__: list[str] = []


def greedy_makespan(p: int, m: int, limit: int, costs: CostModel) -> float | None:
    """The V greedy's best makespan over its fill settings and warm-up rounds (0 to 3 past
    its time rule), None if it finds no order."""
    forward, backward, weight, delay, _ = costs.resolve(2 * p)
    best: float | None = None
    for fill_i, fill_f, extra in itertools.product((True, False), (True, False), range(4)):
        streams = v_greedy_order(p, m, limit, forward, backward, weight, delay,
                                 VGreedyKnobs(fill_i, fill_f, extra))
        if streams is not None:
            found = figures(simulate(Schedule("v-greedy", m, v_placement(p), streams), costs))
            best = found.makespan if best is None else min(best, found.makespan)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-ranks", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    rows: dict[int, list[int]] = {}
    worst, best_gain, no_greedy, no_greedy_at_p, behind = 0.0, 0.0, 0, 0, []
    for p in range(2, args.max_ranks + 1):
        counts = rows.setdefault(p, [0, 0, 0, 0, 0])
        for m in range(p, 3 * p + 1):
            for limit in sorted({max(2, p), 2 * p}):
                forward, backward, weight = ([float(rng.randint(1, 6)) for _ in range(2 * p)]
                                             for _ in range(3))
                costs = CostModel(forward=forward, backward=backward, weight=weight)
                ours = figures(simulate(zb_v_auto(p, m, memory_limit=limit, costs=costs),
                                        costs)).makespan
                theirs = greedy_makespan(p, m, limit, costs)
                counts[3] += 1
                if theirs is None:
                    no_greedy += 1
                    no_greedy_at_p += limit == p
                    counts[4] += 1
                    continue
                difference = (ours - theirs) / theirs
                counts[0 if difference > 1e-9 else 1 if difference >= -1e-9 else 2] += 1
                worst, best_gain = max(worst, difference), min(best_gain, difference)
                if difference > 1e-9:
                    behind.append(f"p={p} m={m} limit={limit}: {ours:g} vs {theirs:g}")
    print("| p | cases | behind | level | ahead | no greedy order |")
    print("|---|---|---|---|---|---|")
    for p, (worse, level, ahead, total, missing) in rows.items():
        print(f"| {p} | {total} | {worse} | {level} | {ahead} | {missing} |")
    total = sum(row[3] for row in rows.values())
    print(f"\n{total} cases; behind the V greedy: {len(behind)}; worst {100 * worst:+.1f}%, "
          f"best {100 * best_gain:+.1f}%; greedy found no order within the limit: {no_greedy} "
          f"({no_greedy_at_p} of them at limit p)")
    for line in behind:
        print("behind:", line)


if __name__ == "__main__":
    main()
