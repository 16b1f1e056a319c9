"""Bubble rate of every schedule on realistic costs; lowering time of ZB-V and interleaved vs torch.

    python benchmarks/bench_schedules.py [--skip-torch] [--time-limit S]

Table 1: simulated bubble rate (the Zero Bubble paper's: 1 - busiest rank / longest rank
span) and peak activations (microbatches of one rank's model share; a chunk of a v-chunk
schedule counts 1/v) under F = 1, B = 1 (input gradient), W = 0.5 per rank share and a comm
delay of 0.05, i.e. F ≈ B ≈ 2W as profiled for transformer layers; a chunk costs 1/v.

Table 2: building the lowered schedule of every rank at p = 64, m = 1024, v = 2. Ours:
generate + `lower` + `add_optimizer_step`. Torch 2.13: constructing the schedule class with
stand-in stages, which builds and lowers every rank's order (`_add_unshard_reshard`,
`_add_reduce_grad`, `_add_send_recv`) — the work each rank's process does at start-up.
For interleaved zero bubble ours lowers torch's own ZB1P compute order, converted with
`schedules.formats.torch_csv` (our `interleaved-zb` searches under costs, which takes minutes at
this size; at p=4 m=8 it finds torch's 51 units at peak 8, see table 3).

Table 3 (`bench_references.reference_table`): each cost-aware schedule against the
reference heuristic and the proven optimum (zb-optimal) at the same placement and memory.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torch_stand_ins import stand_in_stages, timed, torch_order

from schedules import (
    SCHEDULES,
    CostModel,
    Schedule,
    add_optimizer_step,
    build_schedule,
    figures,
    from_torch_rows,
    lower,
    simulate,
)

__all__: list[str] = []

ROWS: tuple[tuple[str, str, int | None], ...] = (  # label, schedule, memory limit (zb-auto)
    ("gpipe", "gpipe", None), ("1f1b", "1f1b", None), ("interleaved (v=2)", "interleaved", None),
    ("looped-bfs (v=2)", "looped-bfs", None), ("zb-h1", "zb-h1", None),
    ("zb-h2", "zb-h2", None), ("zb-v", "zb-v", None), ("dualpipev", "dualpipev", None),
    ("zb-auto (K=p)", "zb-auto", 1), ("zb-auto (K=2p)", "zb-auto", 2),
    ("zb-v-auto (K=2p)", "zb-v-auto", 2), ("interleaved-zb (v=2, K=2p)", "interleaved-zb", 2),
    ("v-half", "v-half", None), ("v-min", "v-min", None),
)
SIZES = tuple((p, k * p) for p in (8, 16, 32) for k in (3, 8))
F, B, W, COMM = 1.0, 1.0, 0.5, 0.05


def bubble_table() -> None:
    print(f"Simulated bubble rate % (peak activations, rank shares); F={F:g} B={B:g} W={W:g} "
          f"per rank share, comm {COMM:g}")
    print()
    print("| schedule | " + " | ".join(f"p={p} m={m}" for p, m in SIZES) + " | time (s) |")
    print("|---|" + "---|" * (len(SIZES) + 1))
    for label, name, limit_per_rank in ROWS:
        v = SCHEDULES[name].default_chunks
        costs = CostModel(forward=F / v, backward=B / v, weight=W / v, comm=COMM)
        cells = []
        start = time.perf_counter()
        for p, m in SIZES:
            limit = None if limit_per_rank is None else limit_per_rank * p
            schedule = build_schedule(name, p, m, memory_limit=limit, costs=costs)
            result = figures(simulate(schedule, costs))
            cells.append(f"{100 * result.bubble_rate:.1f} ({max(result.peak_activations) / v:g})")
        seconds = time.perf_counter() - start
        print(f"| {label} | " + " | ".join(cells) + f" | {seconds:.1f} |")


def lowering_table(skip_torch: bool, p: int = 64, m: int = 1024, v: int = 2) -> None:
    print()
    print(f"Building every rank's lowered schedule, p={p} m={m} v={v}")
    print()
    print("| schedule | instructions | ours (s) | torch (s) | torch / ours | same compute order |")
    print("|---|---|---|---|---|---|")
    rows = (("zb-v", "zb-v", "ScheduleZBVZeroBubble"),
            ("interleaved 1F1B", "interleaved", "ScheduleInterleaved1F1B"),
            ("interleaved zero bubble", "", "ScheduleInterleavedZeroBubble"))
    for label, name, torch_class in rows:
        theirs: float | None = None
        instance = None
        if not skip_torch:
            from torch.distributed.pipelining import schedules as torch_schedules

            cls = getattr(torch_schedules, torch_class)
            theirs, instance = timed(lambda cls=cls: cls(stand_in_stages(p, v), m))
        if name:
            ours, schedule = timed(lambda name=name: build_schedule(name, p, m, v))
            compute: Schedule | None = Schedule(name, m, schedule.placement, tuple(
                tuple(op for op in stream if op.is_compute) for stream in schedule.streams))
        elif instance is not None:
            compute = from_torch_rows(torch_order(instance, p), num_microbatches=m)
            ours, schedule = timed(lambda compute=compute: add_optimizer_step(lower(compute)))
        else:
            print(f"| {label} | | skipped (needs torch's order) | | | |")
            continue
        same = "n/a"
        if not name:
            same = "(torch's order)"
        elif instance is not None and compute is not None:
            loaded = from_torch_rows(torch_order(instance, p), name=compute.name,
                                     num_microbatches=m)
            same = "yes" if loaded.streams == compute.streams else "no"
        torch_text = "skipped" if theirs is None else f"{theirs:.1f}"
        ratio = "" if theirs is None else f"{theirs / ours:,.0f}×"
        print(f"| {label} | {schedule.num_instructions:,} | {ours:.2f} | {torch_text} | {ratio} "
              f"| {same} |", flush=True)


def main() -> None:
    from bench_references import reference_table

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--skip-torch", action="store_true",
                        help="skip torch's lowering (minutes at p=64, m=1024)")
    parser.add_argument("--time-limit", type=float, default=20.0,
                        help="seconds per proven-optimum solve in table 3 (default 20)")
    args = parser.parse_args()
    bubble_table()
    lowering_table(args.skip_torch)
    print()
    reference_table(args.time_limit)


if __name__ == "__main__":
    main()
