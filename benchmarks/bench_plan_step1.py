"""Step 1 of the planner's 3,072-device search, measured: enumerating the configurations, their
memory floors and their time bounds (`pipeline.planner.search.plan` before any schedule is
built), in CPU seconds, the fastest of --runs fresh searches (a shared machine's load only
adds). The whole search is `bench_plan.py --part scale`.

    python benchmarks/bench_plan_step1.py            # 3 runs
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_plan import SCALE_SHAPE  # the 1T shape of `--part scale`

from pipeline.planner import PRESETS, SearchOptions, parse_shape, transformer_profile
from pipeline.planner.bounds import SearchBounds
from pipeline.planner.grid import configurations
from pipeline.planner.search import _context

__all__ = ["main", "step_one"]

TARGET = 1.5
"""CPU seconds for step 1 (issue 33's 10 s for the whole search, split among its parts)."""


def step_one() -> tuple[float, float, float, int]:
    """CPU seconds of the enumeration, the floors (every configuration) and the bounds (those
    that fit), as `plan` asks them, and how many configurations there are."""
    model = transformer_profile(parse_shape(SCALE_SHAPE))
    cluster = replace(PRESETS["a100-80g"], nodes=384)
    options = SearchOptions()
    started = time.process_time()
    configs = list(configurations(model, cluster, 3072, options))
    enumerated = time.process_time()
    bounds = SearchBounds(_context(model, cluster, 3072, None, options))
    floors = [bounds.memory_floor(config) for config in configs]
    floored = time.process_time()
    for config, floor in zip(configs, floors, strict=True):
        if floor <= cluster.device_memory:
            bounds.lower_bound(config)
    bounded = time.process_time()
    return enumerated - started, floored - enumerated, bounded - floored, len(configs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    runs = parser.parse_args().runs
    gc.disable()  # as `plan` runs (`gc_paused`)
    times = [step_one() for _ in range(runs)]
    enumeration, floors, bounds = (min(run[i] for run in times) for i in range(3))
    total = min(sum(run[:3]) for run in times)
    print(f"search step 1 at scale, {SCALE_SHAPE} on 384 × 8 a100-80g, global batch 3072: "
          f"{times[0][3]} configurations; enumeration {enumeration:.2f} s, floors "
          f"{floors:.2f} s, bounds {bounds:.2f} s CPU, together {total:.2f} s (fastest of "
          f"{runs}) -> {'met' if total <= TARGET else 'NOT met'} (target <= {TARGET} s)")


if __name__ == "__main__":
    main()
