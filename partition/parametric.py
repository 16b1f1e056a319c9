"""Exact min-max partitioning of a chain whose stage costs depend on the stage and its cuts."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from partition.prefix_sums import LinearPrefix

__all__ = ["ChainCosts", "choose_cut", "solve_chain", "window_max"]

# Legend: n layers, p stages, stage k (0-based) covers layers [a, b).
#   X_k       prefix of stage k's compute time (layer compute / stage k's speed)
#   cut[c]    seconds to move the tensor crossing cut c; sender and receiver both pay it,
#             and cut[0] = cut[n] = 0
#   M_k       prefix of stage k's memory (it differs per stage: under 1F1B stage k holds
#             min(p - k, m) microbatches of activations)
#   T_k(a, b) = X_k[b] - X_k[a] + cut[a] + cut[b] = h_k(b) - g_k(a)
#             with g_k = X_k - cut and h_k = X_k + cut.
#
# Why not the greedy of `bisection.py`: T_k is not monotone in b (a farther cut may cross a
# bigger tensor), and stages differ, so "take as many layers as fit" can strand a later
# stage. Instead PROBE(B) tracks the full set R_k of cut positions reachable after k stages:
#   b in R_{k+1}  iff  some a in R_k with lo_k(b) <= a < b has g_k(a) >= h_k(b) - B,
# where lo_k(b) is the first start that fits the memory cap. Because T_k separates into
# g_k(a) and h_k(b), that is one prefix maximum (or sliding-window maximum, with a cap) of
# g_k over R_k: O(n) or O(n log n) per stage, exact for every stage-dependent cost.
# The bottleneck is then found by parametric search on B (Iqbal & Bokhari, "Efficient
# algorithms for a class of partitioning problems", IEEE TPDS 6(2), 1995): grow B from a
# lower bound until PROBE succeeds, then bisect, shrinking hi to the attained bottleneck
# after each success, until lo and hi are adjacent floats: no partition is better than the
# one returned, in the probe's arithmetic.
#
# Speed: near B* the reachable positions after k stages lie in a narrow band. X_k is a
# non-negative combination of base prefixes Q_j (`LinearPrefix`); with cap_kj = 1 / (the
# coefficient of Q_j in X_k), any stage costing <= B holds at most B * cap_kj of Q_j, so
# after j stages, for every base,
#   Q[n] - B * sum_{k >= j} cap_k  <=  Q[b_j]  <=  B * sum_{k < j} cap_k,
# and each stage only touches positions in its band (about n / p + (B / B_lower - 1) * n),
# also cut short where the memory cap stops the stage.


_BAND_SLACK = 1e-9
"""Relative widening of the band limits, far above accumulated rounding (~n ulp)."""


@dataclass(frozen=True)
class ChainCosts:
    """Everything the chain solver needs, over cut positions 0..n."""

    compute: LinearPrefix
    """X_k, the prefix of stage k's time without communication."""
    cut: np.ndarray
    """Seconds to move the tensor crossing each cut; zeros when communication is free."""
    memory: LinearPrefix | None = None
    """M_k, the prefix of stage k's memory, or None without a memory cap."""
    memory_cap: float | None = None
    balance_prefix: np.ndarray | None = None
    """Prefix used only to break ties evenly (default: X_0)."""
    balance_shares: np.ndarray | None = None
    """Relative share of each stage when breaking ties (default: equal)."""

    @property
    def num_stages(self) -> int:
        """p."""
        return self.compute.num_stages


@dataclass(frozen=True)
class _Reach:
    """R_k: a boolean mask over positions offset .. offset + len(mask) - 1, with both ends
    reachable."""

    offset: int
    mask: np.ndarray

    @property
    def first(self) -> int:
        return self.offset

    @property
    def last(self) -> int:
        return self.offset + len(self.mask) - 1


def _sparse_table_max(values: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """Range maxima by a sparse table (level j holds the maxima of all windows of length
    2**j); every window must be non-empty."""
    result = np.empty(len(starts))
    # frexp gives x = m * 2**e with 0.5 <= m < 1, so floor(log2(x)) = e - 1, exactly.
    levels = np.frexp((stops - starts).astype(np.float64))[1] - 1
    table = values
    for level in range(int(levels.max()) + 1):
        if level > 0:
            half = 1 << (level - 1)
            table = np.maximum(table[:-half], table[half:])
        chosen = np.flatnonzero(levels == level)
        if chosen.size:
            first, last = starts[chosen], stops[chosen] - (1 << level)
            result[chosen] = np.maximum(table[first], table[last])
    return result


def window_max(values: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """``max(values[starts[i]:stops[i]])`` for every i, -inf where the window is empty or
    holds only -inf; ``stops`` must be >= 1 and non-decreasing.

    Most windows contain the running maximum's latest position, so the running maximum
    answers them; the rest go to a sparse table."""
    result = np.full(len(starts), -np.inf)
    positions = np.arange(len(values))
    running = np.maximum.accumulate(values)
    latest_best = np.maximum.accumulate(np.where(values == running, positions, -1))
    latest_finite = np.maximum.accumulate(np.where(values > -np.inf, positions, -1))
    ends = stops - 1
    occupied = latest_finite[ends] >= starts
    easy = occupied & (latest_best[ends] >= starts)
    result[easy] = running[ends[easy]]
    hard = np.flatnonzero(occupied & ~easy)
    if hard.size:
        result[hard] = _sparse_table_max(values, starts[hard], stops[hard])
    return result


def choose_cut(
    candidates: np.ndarray,
    balance_prefix: np.ndarray,
    stop: int,
    fraction: float,
) -> int:
    """The candidate cut nearest ``fraction`` of the way to ``stop`` in balance_prefix (then
    in index, for zero-cost runs): a cosmetic tie-break among equally optimal cuts."""
    target_value = float(balance_prefix[stop]) * fraction
    target_index = stop * fraction
    order = np.lexsort(
        (np.abs(candidates - target_index), np.abs(balance_prefix[candidates] - target_value))
    )
    return int(candidates[order[0]])


class _Probe:
    """PROBE(B) for one `ChainCosts`, working on band slices only."""

    def __init__(self, costs: ChainCosts) -> None:
        self.costs = costs
        self.num_layers = len(costs.cut) - 1
        # Per base j: capacity_kj = 1 / coefficient_kj, summed over the stages before and
        # from each cut (inf where a stage ignores the base).
        with np.errstate(divide="ignore"):
            capacity = 1.0 / costs.compute.coefficients
        self.before = np.concatenate((np.zeros((1, capacity.shape[1])), np.cumsum(capacity, 0)))
        self.after = np.concatenate(
            (np.cumsum(capacity[::-1], 0)[::-1], np.zeros((1, capacity.shape[1])))
        )
        self.largest = max(
            costs.compute.at(stage, self.num_layers) for stage in range(costs.num_stages)
        )

    def band(self, done: int, bound: float) -> tuple[int, int]:
        """Positions a partition with bottleneck <= bound can reach after ``done`` stages:
        for every base prefix Q_j, a stage costing <= B holds at most B * capacity_kj of it,
        so Q_j[b] <= B * sum_{k < done} capacity_kj and Q_j[n] - Q_j[b] <= B * sum_{k >=
        done} capacity_kj. The limits are widened to cover rounding."""
        n, p = self.num_layers, self.costs.num_stages
        low, high = done, n - (p - done)
        if not math.isfinite(bound):
            return low, high
        per_stage = bound * (1 + _BAND_SLACK) + _BAND_SLACK * (self.largest + bound)
        for index, base in enumerate(self.costs.compute.bases):
            total = float(base[-1])
            with np.errstate(invalid="ignore"):
                ahead = per_stage * self.before[done, index] + _BAND_SLACK * total
                behind = per_stage * self.after[done, index] + _BAND_SLACK * total
            if math.isfinite(ahead):
                high = min(high, int(np.searchsorted(base, ahead, side="right")) - 1)
            if math.isfinite(behind):
                low = max(low, int(np.searchsorted(base, total - behind, side="left")))
        return low, high

    def lower_bound(self) -> float:
        """A bottleneck no partition beats: each base spread over every stage's capacity."""
        best = 0.0
        for index, base in enumerate(self.costs.compute.bases):
            capacity = float(self.before[-1, index])
            if math.isfinite(capacity) and capacity > 0:
                best = max(best, float(base[-1]) / capacity)
        return best * (1 - 1e-6)

    def separated(self, stage: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(g_k, h_k) over positions start .. stop - 1."""
        values = self.costs.compute.window(stage, start, stop)
        cut = self.costs.cut[start:stop]
        return values - cut, values + cut

    def memory_starts(self, stage: int, start: int, stops: np.ndarray) -> np.ndarray | None:
        """For each stop b, the first a >= start with M_k[b] <= M_k[a] + cap (absolute)."""
        memory, cap = self.costs.memory, self.costs.memory_cap
        if memory is None or cap is None:
            return None
        values = memory.window(stage, start, int(stops[-1]) + 1)
        # values + cap is sorted (float addition is monotone), so the search answers
        # "first a with M[b] <= M[a] + cap" exactly, with no subtraction.
        found = np.searchsorted(values + cap, values[stops - start], side="left")
        return np.asarray(start + found, dtype=np.int64)

    def memory_reach(self, stage: int, start: int, limit: int) -> int:
        """The farthest stop <= limit that stage k can reach from ``start`` within the memory
        cap (limit without a cap): a binary search on M_k[b] <= M_k[start] + cap."""
        memory, cap = self.costs.memory, self.costs.memory_cap
        if memory is None or cap is None:
            return limit
        allowed = memory.at(stage, start) + cap
        low, high = start, limit  # M_k[low] fits; find the last b in [low, high] that fits
        while low < high:
            middle = (low + high + 1) // 2
            if memory.at(stage, middle) <= allowed:
                low = middle
            else:
                high = middle - 1
        return low

    def reachable(self, bound: float) -> list[_Reach] | None:
        """[R_0, ..., R_p], or None if position n is not in R_p."""
        n, p = self.num_layers, self.costs.num_stages
        current = _Reach(0, np.ones(1, dtype=bool))
        sets = [current]
        for stage in range(p):
            low, high = self.band(stage + 1, bound)
            low = max(low, current.first + 1)
            high = min(high, self.memory_reach(stage, current.last, high))
            if low > high:
                return None
            a_first, a_last = current.first, min(current.last, high - 1)
            g, _ = self.separated(stage, a_first, a_last + 1)
            masked = np.where(current.mask[: a_last - a_first + 1], g, -np.inf)
            stops = np.arange(low, high + 1)
            starts = self.memory_starts(stage, a_first, stops)
            if starts is None:
                best = np.maximum.accumulate(masked)[np.minimum(stops - 1, a_last) - a_first]
            else:
                best = window_max(masked, starts - a_first, np.minimum(stops, a_last + 1) - a_first)
            _, h = self.separated(stage, low, high + 1)
            fits = (best > -np.inf) & (best >= h - bound)
            hits = np.flatnonzero(fits)
            if hits.size == 0:
                return None
            current = _Reach(low + int(hits[0]), fits[hits[0] : hits[-1] + 1])
            sets.append(current)
        return sets if current.last == n else None

    def extract(self, sets: list[_Reach], bound: float) -> tuple[int, ...]:
        """A partition through the reachable sets: from the end, pick for each stage a start
        in R_k that reaches the current stop (the same test as the forward pass, so one
        exists), nearest an even share of what is left."""
        p = self.costs.num_stages
        balance = self.costs.balance_prefix
        if balance is None:
            balance = self.costs.compute.full(0)
        shares = self.costs.balance_shares
        if shares is None:
            shares = np.ones(p)
        cuts, stop = [self.num_layers], self.num_layers
        for stage in range(p - 1, 0, -1):
            reach = sets[stage]
            a_first, a_last = reach.first, min(reach.last, stop - 1)
            g, _ = self.separated(stage, a_first, a_last + 1)
            _, h = self.separated(stage, stop, stop + 1)
            fits = reach.mask[: a_last - a_first + 1] & (g >= h[0] - bound)
            starts = self.memory_starts(stage, a_first, np.array([stop]))
            if starts is not None:
                fits[: int(starts[0]) - a_first] = False
            candidates = a_first + np.flatnonzero(fits)
            if candidates.size == 0:
                raise RuntimeError(f"internal error: stage {stage} has no start under {bound!r}")
            before = float(shares[:stage].sum())
            stop = choose_cut(candidates, balance, stop, before / (before + float(shares[stage])))
            cuts.append(stop)
        cuts.append(0)
        return tuple(reversed(cuts))

    def bottleneck(self, boundaries: tuple[int, ...]) -> float:
        """max_k h_k(b_{k+1}) - g_k(b_k): the partition's slowest stage."""
        worst = 0.0
        for stage in range(self.costs.num_stages):
            g, _ = self.separated(stage, boundaries[stage], boundaries[stage] + 1)
            _, h = self.separated(stage, boundaries[stage + 1], boundaries[stage + 1] + 1)
            worst = max(worst, float(h[0] - g[0]))
        return worst


def _midpoint(low: float, high: float) -> float:
    """The float halfway between two non-negative floats in bit-pattern order."""
    low_bits = int(np.float64(low).view(np.int64))
    high_bits = int(np.float64(high).view(np.int64))
    return float(np.int64((low_bits + high_bits) // 2).view(np.float64))


def solve_chain(costs: ChainCosts) -> tuple[tuple[int, ...], float] | None:
    """Optimal boundaries and bottleneck for a chain with stage- and cut-dependent costs, or
    None when no partition fits the memory cap."""
    probe = _Probe(costs)
    # Phase 1: grow B from a lower bound (steps 5%, 10%, 20%, ... above it) until PROBE
    # succeeds; past the largest possible stage time it is a pure memory check.
    lo = probe.lower_bound()
    largest = probe.largest + 2 * float(costs.cut.max(initial=0.0))
    bound, step = lo, 0.05
    while True:
        sets = probe.reachable(bound)
        if sets is not None:
            break
        lo = bound
        if bound > largest:
            return None
        bound = max(lo * (1 + step), lo + 1e-300)
        step *= 2
        if bound > largest:
            bound = math.inf
    best = probe.extract(sets, bound)
    hi = min(probe.bottleneck(best), bound)
    if bound == lo:
        return best, probe.bottleneck(best)
    # Phase 2. Invariant: PROBE(lo) fails and `best` attains a bottleneck <= hi. Bisecting
    # the bit patterns of non-negative doubles (ordered like their values) halves the floats
    # left in (lo, hi) each step: at most 64 probes, ending at adjacent floats.
    while True:
        mid = _midpoint(lo, hi)
        if not lo < mid < hi:
            break
        sets = probe.reachable(mid)
        if sets is None:
            lo = mid
        else:
            best = probe.extract(sets, mid)
            hi = min(probe.bottleneck(best), mid)
    return best, probe.bottleneck(best)
