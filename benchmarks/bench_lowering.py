"""How lowering scales against torch.distributed.pipelining, and simulator throughput.

    python benchmarks/bench_lowering.py [--skip-torch-at 64]

Ours: generate + lower (send/recv, loads) + reduce-grad/step pass for *every* rank.
Torch: constructing `ScheduleInterleaved1F1B`, which builds and lowers every rank's order
on each rank (stand-in stages: lowering needs no process group). `bench_schedules.py`
compares the zero-bubble schedules at p=64, m=1024.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from torch_stand_ins import stand_in_stages, timed

from schedules import build_schedule, simulate

__all__: list[str] = []


def time_ours(p: int, m: int, v: int, repeats: int = 3) -> tuple[float, int]:
    runs = [timed(lambda: build_schedule("interleaved", p, m, v)) for _ in range(repeats)]
    return statistics.median(seconds for seconds, _ in runs), runs[0][1].num_instructions


def time_torch(p: int, m: int, v: int) -> float:
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    return timed(lambda: ScheduleInterleaved1F1B(stand_in_stages(p, v), m))[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--skip-torch-at", type=int, default=0, metavar="P",
                        help="skip torch for p >= P (it takes minutes at p=64)")
    args = parser.parse_args()
    print("| p | m | v | instructions | ours: all ranks (s) | torch: one rank (s) | torch / ours |")
    print("|---|---|---|---|---|---|---|")
    for p, m, v in ((16, 128, 2), (32, 256, 2), (64, 1024, 2)):
        ours, count = time_ours(p, m, v)
        if args.skip_torch_at and p >= args.skip_torch_at:
            print(f"| {p} | {m} | {v} | {count:,} | {ours:.2f} | skipped | |")
            continue
        theirs = time_torch(p, m, v)
        print(f"| {p} | {m} | {v} | {count:,} | {ours:.2f} | {theirs:.1f} | {theirs / ours:.0f}× |")

    print()
    print("| simulated schedule | instructions | compute ops | simulate (s) | instructions/s |")
    print("|---|---|---|---|---|")
    for p, m, v in ((64, 1024, 2), (64, 1312, 2)):
        schedule = build_schedule("interleaved", p, m, v)
        seconds = []
        for _ in range(3):
            start = time.perf_counter()
            timeline = simulate(schedule)
            seconds.append(time.perf_counter() - start)
        best = statistics.median(seconds)
        print(f"| interleaved p={p} m={m} v={v} | {schedule.num_instructions:,} | "
              f"{len(timeline):,} | {best:.2f} | {schedule.num_instructions / best:,.0f} |")


if __name__ == "__main__":
    main()
