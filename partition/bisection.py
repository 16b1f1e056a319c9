"""Exact min-max contiguous partitioning when every stage has the same monotone cost."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from partition.boundaries import check_stage_count
from partition.errors import InvalidCostError

__all__ = ["MonotoneSolution", "closest_cut", "partition_weights", "solve_monotone"]

# The chains-on-chains problem: cut n weighted layers into p contiguous non-empty stages
# so that the heaviest stage is as light as possible.
#
# Legend: n layers, p stages, prefix[i] = w_0 + ... + w_{i-1} (non-decreasing), stage
# [a, b) costs prefix[b] - prefix[a]; B is a candidate bottleneck. An optional memory prefix
# M adds the constraint M[b] - M[a] <= cap, the same for every stage.
#
# Algorithm: exact bisection ("EBS") of Pinar & Aykanat, "Fast optimal load balancing
# algorithms for 1D partitioning", J. Parallel Distrib. Comput. 64(8), 2004, section 4.1.
#   PROBE(B): the greedy gives each stage as many layers as fit under B (and the cap).
#     Because cost is monotone (a sub-interval never costs more), the greedy's k-th cut is
#     the farthest any feasible partition can reach after k stages, so it covers all n
#     layers in <= p stages iff some p-stage partition has bottleneck <= B (splitting a
#     stage never breaks feasibility, so fewer stages are fine as p <= n).
#   Bisection keeps lo <= B* <= hi with both ends *attained* values:
#     - PROBE(mid) succeeds: hi = the greedy partition's own bottleneck (<= mid).
#     - PROBE(mid) fails: any B that succeeds must let some greedy stage take one more
#       layer (otherwise the greedy is unchanged and still fails), so
#       lo = min over stages of (that stage's cost with its next layer) > mid.
#   Each step strictly shrinks [lo, hi] to attained values, and it ends at lo = hi = B*.
# All comparisons use the probe's own arithmetic, prefix[b] <= prefix[a] + B, so the
# result is exact in floating point, not just to a tolerance.


@dataclass(frozen=True, slots=True)
class MonotoneSolution:
    """An optimal partition and its bottleneck (the largest stage cost)."""

    boundaries: tuple[int, ...]
    bottleneck: float


def _bits(value: float) -> int:
    """The IEEE-754 bit pattern of a non-negative double; it orders like the value."""
    return int(struct.unpack("<q", struct.pack("<d", value))[0])


def _from_bits(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", bits))[0])


def _minimal_fit(prefix_start: float, prefix_stop: float) -> float:
    """The smallest float B with prefix_stop <= prefix_start + B: the stage's cost as the
    probe sees it (usually just the difference; rounding can shift it by an ulp)."""
    # Python floats: the same IEEE arithmetic as numpy's scalars, far cheaper per step
    prefix_start, prefix_stop = float(prefix_start), float(prefix_stop)
    need = max(prefix_stop - prefix_start, 0.0)
    if prefix_start + need >= prefix_stop and (
        need == 0 or prefix_start + math.nextafter(need, 0.0) < prefix_stop
    ):
        return need
    # Rounding makes a run of B values equivalent: find the run's start by bisecting the
    # bit patterns (at most 64 steps). Invariant: low does not fit, high fits.
    step = math.ulp(prefix_stop)
    high = need + step
    while prefix_start + high < prefix_stop:
        step *= 2
        high = need + step
    low_bits, high_bits = -1, _bits(high)
    # the run starts within an ulp of prefix_stop below `need`: start there when that
    # does not fit (checked, so the invariant holds; else from 0 as before)
    below = need - 2 * math.ulp(prefix_stop)
    if below >= 0.0 and prefix_start + below < prefix_stop:
        low_bits = _bits(below)
    while high_bits - low_bits > 1:
        middle = (low_bits + high_bits) // 2
        if prefix_start + _from_bits(middle) >= prefix_stop:
            high_bits = middle
        else:
            low_bits = middle
    return _from_bits(high_bits)


def _extreme_fit(
    prefix: np.ndarray, starts: Sequence[int], stops: Sequence[int], largest: bool
) -> float:
    """The largest (or smallest) `_minimal_fit` over stages [starts[i], stops[i]). A fit is
    within one ulp of the top prefix of its difference, so only stages whose difference
    is that close to the extreme need the exact (slower) fit."""
    first, last = np.asarray(starts), np.asarray(stops)
    differences = prefix[last] - prefix[first]
    extreme = differences.max() if largest else differences.min()
    near = np.abs(differences - extreme) <= 4 * math.ulp(float(prefix[-1]))
    fits = [
        _minimal_fit(prefix[a], prefix[b]) for a, b in zip(first[near], last[near], strict=True)
    ]
    return max(fits) if largest else min(fits)


def closest_cut(
    prefix: np.ndarray, low: int, high: int, target_value: float, target_index: float
) -> int:
    """The index in [low, high] whose prefix is closest to ``target_value``; among equal
    prefixes (zero-cost layers), the one closest to ``target_index``."""
    window = prefix[low : high + 1]
    spot = int(np.searchsorted(window, target_value))
    options = [i for i in (spot - 1, spot) if 0 <= i < len(window)]
    best = min(options, key=lambda i: abs(float(window[i]) - target_value))
    value = window[best]
    first = int(np.searchsorted(window, value, side="left"))
    last = int(np.searchsorted(window, value, side="right")) - 1
    return low + min(max(round(target_index) - low, first), last)


class _Greedy:
    """The greedy probe over one prefix array, with an optional per-stage memory cap."""

    def __init__(
        self,
        prefix: np.ndarray,
        num_stages: int,
        memory_prefix: np.ndarray | None,
        memory_cap: float | None,
    ) -> None:
        self.prefix = prefix
        self.num_layers = len(prefix) - 1
        self.num_stages = num_stages
        self.memory_prefix = memory_prefix
        self.memory_cap = memory_cap
        # Where memory alone lets a stage starting at a reach; independent of B.
        self.memory_reach: np.ndarray | None = None
        if memory_prefix is not None and memory_cap is not None:
            reach = np.searchsorted(memory_prefix, memory_prefix + memory_cap, side="right") - 1
            self.memory_reach = reach

    def probe(self, bound: float) -> tuple[list[int] | None, float]:
        """Greedy stage ends if the layers fit in <= p stages under ``bound``, else None;
        plus the smallest bound that lets some compute-limited stage take one more layer."""
        prefix, n = self.prefix, self.num_layers
        start, ends = 0, []
        blocked_starts, blocked_stops = [], []  # stages whose next layer exceeds the bound
        feasible = False
        for _ in range(self.num_stages):
            compute_end = int(np.searchsorted(prefix, prefix[start] + bound, side="right")) - 1
            memory_end = n if self.memory_reach is None else int(self.memory_reach[start])
            end = min(compute_end, memory_end)
            if end >= n:
                ends.append(n)
                feasible = True
                break
            if compute_end < memory_end:
                blocked_starts.append(start)
                blocked_stops.append(end + 1)
            if end <= start:
                break
            ends.append(end)
            start = end
        if feasible:
            return ends, math.inf
        if not blocked_starts:
            return None, math.inf
        return None, _extreme_fit(prefix, blocked_starts, blocked_stops, largest=False)

    def bottleneck(self, ends: Sequence[int]) -> float:
        """The largest stage cost of consecutive stage ends, in the probe's arithmetic."""
        return _extreme_fit(self.prefix, [0, *ends[:-1]], ends, largest=True)

    def first_starts(self, bound: float) -> Callable[[int], int]:
        """For a stop b, the smallest a such that stage [a, b) fits ``bound`` and the cap.
        prefix + bound is sorted (float addition is monotone), so one search is exact."""
        shifted = self.prefix + bound
        memory_shifted = (
            self.memory_prefix + self.memory_cap
            if self.memory_prefix is not None and self.memory_cap is not None
            else None
        )

        def first_start(stop: int) -> int:
            start = int(np.searchsorted(shifted, self.prefix[stop], side="left"))
            if memory_shifted is not None and self.memory_prefix is not None:
                memory_start = np.searchsorted(memory_shifted, self.memory_prefix[stop])
                start = max(start, int(memory_start))
            return start

        return first_start

    def balanced_boundaries(self, bound: float) -> tuple[int, ...]:
        """Among the partitions with bottleneck <= ``bound``, one whose stages are close to
        equal: walk back from the end, placing each cut nearest an even share of what is
        left. The set of positions reachable after k stages is the interval [k, U_k] with U_k
        the greedy's k-th end, so every choice inside it keeps a completion."""
        ends, _ = self.probe(bound)
        if ends is None:
            raise RuntimeError(f"internal error: bound {bound!r} was proven feasible")
        n, p = self.num_layers, self.num_stages
        farthest = [0, *ends, *([n] * (p - len(ends)))]
        first_start = self.first_starts(bound)
        cuts, stop = [n], n
        for stage in range(p - 1, 0, -1):
            low = max(stage, first_start(stop))
            high = min(farthest[stage], stop - 1)
            if low > high:
                raise RuntimeError(f"internal error: no cut for stage {stage} under {bound!r}")
            fraction = stage / (stage + 1)
            stop = closest_cut(
                self.prefix, low, high, float(self.prefix[stop]) * fraction, stop * fraction
            )
            cuts.append(stop)
        cuts.append(0)
        return tuple(reversed(cuts))


def solve_monotone(
    prefix: np.ndarray,
    num_stages: int,
    *,
    memory_prefix: np.ndarray | None = None,
    memory_cap: float | None = None,
) -> MonotoneSolution | None:
    """Optimal p-stage partition of the chain with stage cost ``prefix[b] - prefix[a]``
    (and ``memory_prefix[b] - memory_prefix[a] <= memory_cap``); None if the cap admits no
    partition. O(p log n) per probe, O(log(range)) probes."""
    greedy = _Greedy(prefix, num_stages, memory_prefix, memory_cap)
    ends, _ = greedy.probe(math.inf)
    if ends is None:
        return None
    hi = greedy.bottleneck(ends)
    # B* >= the heaviest layer and >= the mean stage; the slack covers rounding, so lo
    # stays a true lower bound and hi / lo <= about p (few bisection steps).
    total = float(prefix[-1])
    heaviest = float(np.max(np.diff(prefix))) if len(prefix) > 1 else 0.0
    lo = max(0.0, max(heaviest, total / num_stages) - 4 * math.ulp(total))
    while lo < hi:
        mid = lo + (hi - lo) / 2
        if mid >= hi:
            mid = lo
        ends, next_bound = greedy.probe(mid)
        if ends is not None:
            hi = min(greedy.bottleneck(ends), mid)
        else:
            lo = next_bound
    return MonotoneSolution(greedy.balanced_boundaries(hi), hi)


def partition_weights(weights: Sequence[float] | np.ndarray, num_stages: int) -> tuple[int, ...]:
    """Exact min-max contiguous split of non-negative weights into ``num_stages`` stages:
    the p+1 cut indices (first 0, last n) minimising the largest stage sum. Among optimal
    splits, stages are kept close to an even share."""
    values = np.asarray(weights, dtype=np.float64)
    if values.ndim != 1:
        raise InvalidCostError([f"weights must be a flat sequence, got shape {values.shape}"])
    bad = np.flatnonzero(~np.isfinite(values) | (values < 0))
    if bad.size:
        raise InvalidCostError(
            [f"weights[{int(i)}]={float(values[i])!r}" for i in bad[:10]]
            + ([f"... and {bad.size - 10} more"] if bad.size > 10 else [])
        )
    num_stages = check_stage_count(num_stages, len(values))
    prefix = np.concatenate(([0.0], np.cumsum(values)))
    solution = solve_monotone(prefix, num_stages)
    if solution is None:
        raise RuntimeError("internal error: an uncapped partition is always feasible")
    return solution.boundaries
