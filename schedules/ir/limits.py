"""Size limits of what the schedules package builds, and the estimate that enforces them.

A schedule holds one small tuple per instruction (about 100 bytes each, measured with
tracemalloc on 1F1B, ZB-H1 and interleaved builds), and lowering, simulating and plotting
all take time linear in that count. Asking for 10^7 stages or microbatches would build
billions of them and run until killed, so the entry points estimate the count from p, m
and v first (integer arithmetic, instant for any size) and refuse past the limits here.
"""

from __future__ import annotations

import math

from schedules.ir.errors import ScheduleConfigError

__all__ = [
    "BYTES_PER_INSTRUCTION",
    "MAX_COST",
    "MAX_INSTRUCTIONS",
    "ScheduleTooLargeError",
    "check_schedule_size",
    "estimate_instructions",
]

MAX_INSTRUCTIONS = 5_000_000
"""Most instructions (all ranks together, after lowering) a schedule may have: about 0.5 GB
and ten seconds to build here. Interleaved p=64, m=2048, v=4 has 3.1 million; real runs
(p ≤ 128, m ≤ 1024) stay well below."""

BYTES_PER_INSTRUCTION = 100
"""Memory of one instruction in a built schedule, for the estimate in error messages."""

MAX_COST = 1e15
"""Largest per-op time or byte count the command line takes: a 10^15-unit op times a few
million ops still sums to a finite makespan, where 1e308 overflows to inf and NaN."""


class ScheduleTooLargeError(ScheduleConfigError):
    """p, m and v that would build more than `MAX_INSTRUCTIONS` instructions."""

    def __init__(self, message: str, *, estimate: int) -> None:
        self.estimate = estimate
        super().__init__(message)


def estimate_instructions(num_ranks: int, num_microbatches: int, chunks: int, *,
                          lowered: bool = True) -> int:
    """An upper bound on the instructions of any schedule for p ranks, m microbatches and v
    chunks per rank (S = p·v stages).

    Compute: at most F, I and W for each (stage, microbatch): 3·S·m. Lowering adds, per
    microbatch, a SEND and a RECV each way across each of the S - 1 stage boundaries
    (4·(S - 1)·m), a LOAD on the first and the last stage (2·m), one REDUCE_GRAD per stage
    and one STEP per rank. Schedules with a fused B have 2·S·m compute ops, so the bound is
    within 1.3× of the real count for them and exact for the zero-bubble ones.
    """
    stages = num_ranks * chunks
    compute = 3 * stages * num_microbatches
    if not lowered:
        return compute
    return compute + 4 * (stages - 1) * num_microbatches + 2 * num_microbatches \
        + stages + num_ranks


def _shown(count: int) -> str:
    """A count as written, in floating notation when long, or as a power of ten when even
    a float cannot hold it (str() itself refuses ints of over 4,300 digits)."""
    if count.bit_length() <= 50:
        return f"{count:,}"
    if count.bit_length() < 1000:
        return f"{float(count):.3g}"
    return f"10^{int(count.bit_length() * math.log10(2))}"


def check_schedule_size(num_ranks: object, num_microbatches: object, chunks: object, *,
                        lowered: bool = True,
                        names: tuple[str, str, str] = ("num_ranks", "num_microbatches",
                                                       "chunks")) -> int:
    """Return the estimate, or raise `ScheduleTooLargeError` if it is over `MAX_INSTRUCTIONS`.

    `names` are how the caller spells p, m and v in the message (the command line passes
    its flags, e.g. ``("--stages", "--microbatches", "--chunks")``). Values that are not
    ints >= 1 give 0 here: the callers' own count checks name them.
    """
    counts = [x for x in (num_ranks, num_microbatches, chunks)
              if isinstance(x, int) and not isinstance(x, bool) and x >= 1]
    if len(counts) != 3:
        return 0
    p, m, v = counts
    estimate = estimate_instructions(p, m, v, lowered=lowered)
    if estimate > MAX_INSTRUCTIONS:
        p_name, m_name, v_name = names
        per_stage_microbatch = 7 if lowered else 3
        megabytes = estimate * BYTES_PER_INSTRUCTION // 10**6
        raise ScheduleTooLargeError(
            f"{p_name} {_shown(p)}, {m_name} {_shown(m)}, {v_name} {_shown(v)} would build "
            f"{_shown(estimate)} instructions (about {_shown(megabytes)} MB), over the limit of "
            f"{MAX_INSTRUCTIONS:,} (schedules.ir.limits.MAX_INSTRUCTIONS); lower {p_name}, "
            f"{m_name} or {v_name} so that p·v·m stays under about "
            f"{MAX_INSTRUCTIONS // per_stage_microbatch:,}", estimate=estimate)
    return estimate
