"""Limits of a run, checked before any process starts: timeouts, local ranks, run length."""

from __future__ import annotations

import math
import os

from pipeline.errors import PipelineConfigError

__all__ = ["MAX_COUNT", "MAX_INPUT_BYTES", "MAX_NUMBER", "MAX_RUN_SECONDS", "MAX_SOURCE_BYTES",
           "MAX_TIMEOUT", "RANK_BYTES", "check_local_ranks",
           "check_run_seconds", "check_timeout", "host_memory_bytes", "max_local_ranks"]

MAX_TIMEOUT = 30 * 24 * 3600.0
"""Longest timeout, in seconds, a wait may be given (30 days): torch keeps timeouts as
milliseconds in a 64-bit count and `timedelta` stops at 10^9 days, so 1e12 s or 1e300 s
ended in an OverflowError deep inside the process-group set-up."""
RANK_BYTES = 150 << 20
"""Memory one local rank takes before it holds any model (an interpreter with torch
imported), for the estimate of how many ranks this host can start."""
MAX_RUN_SECONDS = 7 * 24 * 3600.0
"""Longest run, in estimated seconds, the command line starts (a week)."""
MAX_COUNT = 2**40
"""Largest count any command-line flag takes (about 10^12): steps, ranks, microbatches,
sizes and repeats beyond it are typos, and each command bounds its own work further."""
MAX_NUMBER = 1e15
"""Largest magnitude of any other number on the command line (a cost, a scale, a factor):
beyond it sums overflow to inf and outputs print 300-digit numbers."""
MAX_INPUT_BYTES = 64 << 20
"""Largest input file any command reads (a costs file, a schedule, a cluster, a profile)."""
MAX_SOURCE_BYTES = 16 << 20
"""Largest Python file `train --model FILE.py:FUNCTION` imports."""


def check_timeout(seconds: object, name: str = "timeout") -> float:
    """`seconds` as a float, or `PipelineConfigError` unless a finite number in
    (0, `MAX_TIMEOUT`]."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or \
            not (math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT):
        raise PipelineConfigError(f"{name} must be a number of seconds in (0, {MAX_TIMEOUT:g}] "
                                  f"(30 days), got {seconds!r}")
    return float(seconds)


def host_memory_bytes() -> int:
    """This host's physical memory (1,024 ranks' worth where the system does not say)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        return 1024 * RANK_BYTES


def max_local_ranks() -> int:
    """How many ranks this host can start: its memory over `RANK_BYTES` (at least 8)."""
    return max(8, host_memory_bytes() // RANK_BYTES)


def check_local_ranks(count: int, what: str = "world_size") -> None:
    """`PipelineConfigError` if `count` local ranks would not fit in this host's memory."""
    limit = max_local_ranks()
    if count > limit:
        raise PipelineConfigError(
            f"{what} {count:,} would start {count:,} local processes, over the {limit:,} this "
            f"host's memory holds at about {RANK_BYTES >> 20} MiB each; use fewer ranks, or "
            "run across hosts under torchrun")


def check_run_seconds(seconds: float, what: str, limit: float = MAX_RUN_SECONDS) -> None:
    """`PipelineConfigError` if a run estimated at `seconds` is longer than `limit`; `what`
    names the flags that set its length."""
    if not seconds <= limit:  # also refuses inf and NaN
        def shown(value: float) -> str:
            if not math.isfinite(value):
                return "forever"
            return f"{value / 86400:.3g} days" if value >= 86400 else f"{value / 3600:.3g} hours"
        raise PipelineConfigError(f"the run would take about {shown(seconds)}, over the limit "
                                  f"of {shown(limit)}; lower {what}")
