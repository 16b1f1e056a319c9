"""Schedule generation in the 3,072-device plan search: the generators against their frozen
copies from before issue 33's speed-up (`tests/support/reference_generators`), same run.

The search (`bench_plan.py --part scale`) is run once with `generate_schedule` wrapped to
record its calls (98: 1F1B, interleaved, ZB-H1/H2, ZB-V, DualPipeV with and without the
overlap, V-Half, V-Min); each side then makes exactly those schedules in a fresh process
(the shared instructions of `stage_ops` start empty, as in a search), the two sides
alternated --rounds times. CPU seconds per schedule name, by `time.process_time`, the
garbage collector paused as `generate_schedule` pauses it; both sides' schedules are
compared equal in the first round.

    PYTHONPATH=. python benchmarks/bench_generators.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

__all__ = ["main"]

Call = tuple[str, int, int, int]


def record_calls() -> list[Call]:
    """The (name, p, m, v) of every `generate_schedule` call of the scale search, in order."""
    from bench_plan import scale_search

    import pipeline.planner.predict as predict

    calls: list[Call] = []
    original = predict.generate_schedule

    def recording(name: str, p: int, m: int, v: int | None = None, **kwargs: Any) -> Any:
        assert v is not None, "the planner always passes chunks"
        calls.append((name, p, m, v))
        return original(name, p, m, v, **kwargs)

    predict.generate_schedule = recording  # type: ignore[assignment]
    try:
        print(scale_search(), flush=True)
    finally:
        predict.generate_schedule = original
    return calls


def _makers(side: str) -> Callable[[Call], object]:
    from schedules.ir.schedule import gc_paused

    if side == "fast":
        from schedules.registry import generate_schedule
        return lambda call: generate_schedule(*call)
    from tests.support.reference_generators import (
        classic,
        controllable_memory,
        dualpipe,
        zb_h1_h2,
        zb_v,
    )
    reference: dict[str, Callable[[int, int, int], object]] = {
        "1f1b": lambda p, m, v: classic.one_f_one_b(p, m),
        "interleaved": classic.interleaved_1f1b,
        "zb-h1": lambda p, m, v: zb_h1_h2.zb_h1(p, m),
        "zb-h2": lambda p, m, v: zb_h1_h2.zb_h2(p, m),
        "zb-v": lambda p, m, v: zb_v.zb_v(p, m),
        "dualpipev": lambda p, m, v: dualpipe.dualpipev(p, m),
        "dualpipev-overlap": lambda p, m, v: dualpipe.dualpipev(p, m, overlap=True),
        "v-half": lambda p, m, v: controllable_memory.v_half(p, m),
        "v-min": lambda p, m, v: controllable_memory.v_min(p, m),
    }
    return lambda call: gc_paused(reference[call[0]])(*call[1:])


def time_side(side: str, calls: list[Call], keep: str | None) -> dict[str, float]:
    """CPU seconds per schedule name of making every call on one side (in this process);
    with `keep`, the schedules' text (or the refusal) is written there for comparison."""
    make = _makers(side)
    seconds: Counter[str] = Counter()
    made = []
    for call in calls:
        start = time.process_time()
        try:
            schedule: Any = make(call)
        except ValueError as error:
            schedule = f"{type(error).__name__}: {error}"
        seconds[call[0]] += time.process_time() - start
        if keep:
            made.append(schedule if isinstance(schedule, str) else
                        [schedule.name, schedule.placement, schedule.format()])
    if keep:
        with open(keep, "w") as file:
            json.dump(made, file)
    return dict(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--side", choices=("fast", "reference"), help=argparse.SUPPRESS)
    parser.add_argument("--calls", help=argparse.SUPPRESS)
    parser.add_argument("--keep", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:  # a child: time one side, print its figures
        with open(args.calls) as file:
            calls = [tuple(call) for call in json.load(file)]
        print(json.dumps(time_side(args.side, calls, args.keep)))  # type: ignore[arg-type]
        return
    calls = record_calls()
    print(f"{len(calls)} generate_schedule calls", flush=True)
    totals: dict[str, list[dict[str, float]]] = {"reference": [], "fast": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "calls.json")
        with open(path, "w") as file:
            json.dump(calls, file)
        for round_ in range(args.rounds):
            for side in ("reference", "fast"):
                command = [sys.executable, __file__, "--side", side, "--calls", path]
                if round_ == 0:
                    command += ["--keep", os.path.join(tmp, f"{side}.json")]
                done = subprocess.run(command, capture_output=True, text=True, check=True,
                                      env={**os.environ, "PYTHONPATH": ROOT})
                totals[side].append(json.loads(done.stdout.splitlines()[-1]))
        with open(os.path.join(tmp, "reference.json")) as a, \
                open(os.path.join(tmp, "fast.json")) as b:
            same = json.load(a) == json.load(b)
    print(f"schedules identical to the reference's: {same}")
    names = sorted({name for run in totals["reference"] for name in run},
                   key=lambda name: -totals["reference"][0].get(name, 0.0))
    print("| schedule | calls | reference CPU s | fast CPU s | fast / reference |")
    print("|---|---|---|---|---|")
    for name in [*names, "all"]:
        ref = [sum(run.values()) if name == "all" else run.get(name, 0.0)
               for run in totals["reference"]]
        new = [sum(run.values()) if name == "all" else run.get(name, 0.0)
               for run in totals["fast"]]
        count = len(calls) if name == "all" else sum(call[0] == name for call in calls)
        print(f"| {name} | {count} | {_span(ref)} | {_span(new)} | "
              f"{_span([n / r for n, r in zip(new, ref) if r])} |")


def _span(values: list[float]) -> str:
    low, high = min(values), max(values)
    return f"{low:.3f}" if f"{low:.3f}" == f"{high:.3f}" else f"{low:.3f}–{high:.3f}"


if __name__ == "__main__":
    main()
