"""How much work a plan request asks for, estimated from its sizes before the search starts.

The search enumerates every (tp, pp, schedule, v, microbatch size, ZeRO, recompute) grid
point and simulates the promising ones; a simulated configuration costs time linear in its
instructions, about 3·p·v·m. A global batch of 720,720 (240 divisors, up to 720,720
microbatches per replica) or 10^12 nodes would run for hours, so the command line refuses
requests whose bound below is over `MAX_PLAN_INSTRUCTIONS`, naming what to lower. Sizes are
checked first so that the estimate itself is instant (divisors by trial division to √n).
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.planner.errors import PlanError
from schedules import SCHEDULES

__all__ = ["MAX_DEVICES", "MAX_GLOBAL_BATCH", "MAX_LAYERS", "MAX_PLAN_INSTRUCTIONS", "VARIANTS",
           "check_plan_work", "divisors", "estimate_plan_work"]

MAX_LAYERS = 100_000
"""Most layers a planned model may have (a profile holds a few numbers per layer)."""
MAX_DEVICES = 1 << 20
"""Most devices (nodes × devices per node) a plan may spread over."""
MAX_GLOBAL_BATCH = 1 << 30
"""Largest global batch, in samples, a plan may be asked for."""
MAX_PLAN_INSTRUCTIONS = 2_000_000_000
"""Bound on the instructions the search may simulate, summed over every configuration it
enumerates (most are pruned before they are simulated): the Megatron-LM paper's largest
runs (1T on 3,072 devices, a global batch of 3,072) are about 8·10^8 and search in well under
a minute; a global batch of 720,720 on 8 devices is 8·10^10."""


def divisors(n: int) -> list[int]:
    """The divisors of n >= 1, ascending, in O(√n) steps."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


VARIANTS = 2 * 6
"""ZeRO 0 and 1 × the searched recomputation settings: none, selective, full and partial with
up to three layer counts (a quarter, half and three quarters of a stage: `search.py`)."""


def estimate_plan_work(num_layers: int, devices: int, tensor_parallel: Sequence[int],
                       global_batch: int, schedules: Sequence[str], max_chunks: int) -> int:
    """An upper bound on the instructions the search would simulate: for every grid point
    it enumerates, 3·p·v·m (F, B and W per stage and microbatch), times `VARIANTS` for the
    ZeRO and recomputation variants."""
    total = 0
    for tp in tensor_parallel:
        if tp < 1 or devices % tp:
            continue
        for pp in divisors(devices // tp):
            dp = devices // (tp * pp)
            if pp > num_layers or global_batch % dp:
                continue
            microbatch_total = sum(divisors(global_batch // dp))  # Σ m over microbatch sizes
            names = ("1f1b",) if pp == 1 else schedules
            for name in names:
                low, high = SCHEDULES[name].chunks if name in SCHEDULES else (1, 1)
                top = min(max_chunks, num_layers // pp) if high is None else low
                chunk_total = sum(range(max(low, 2) if high is None else low, top + 1))
                total += 3 * pp * chunk_total * microbatch_total * VARIANTS
    return total


def check_plan_work(num_layers: int, nodes: int, devices_per_node: int,
                    tensor_parallel: Sequence[int], global_batch: int,
                    schedules: Sequence[str], max_chunks: int) -> int:
    """The estimate, or `PlanError` naming the value to lower when a size or the work is
    over its limit."""
    devices = nodes * devices_per_node
    if num_layers > MAX_LAYERS:
        raise PlanError(f"the model has {num_layers:,} layers, over the planner's limit of "
                        f"{MAX_LAYERS:,}; plan a model with fewer layers (group layers into "
                        "blocks in the cost file)")
    if devices > MAX_DEVICES:
        raise PlanError(f"--nodes {nodes:,} gives "
                        f"{devices:,} devices, over the planner's limit of {MAX_DEVICES:,}; "
                        "use fewer --nodes")
    if global_batch > MAX_GLOBAL_BATCH:
        raise PlanError(f"--global-batch {global_batch:,} is over the planner's limit of "
                        f"{MAX_GLOBAL_BATCH:,} samples; give the batch of one optimizer step")
    work = estimate_plan_work(num_layers, devices, tensor_parallel, global_batch, schedules,
                              max_chunks)
    if work > MAX_PLAN_INSTRUCTIONS:
        counts = len(divisors(global_batch))
        raise PlanError(
            f"--global-batch {global_batch:,} on {devices:,} devices would have the search "
            f"simulate up to {work:.2g} instructions ({counts} microbatch sizes, up to "
            f"{global_batch:,} microbatches a replica), over the limit of "
            f"{MAX_PLAN_INSTRUCTIONS:.2g} (pipeline.planner.limits); use a smaller "
            "--global-batch, or fewer --schedules")
    return work
