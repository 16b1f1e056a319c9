"""Exact min-max partitioning of a chain whose stage costs depend on the stage and its cuts."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

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
# The bottleneck is then found by bisection on B (Iqbal & Bokhari style parametric search,
# "Efficient algorithms for a class of partitioning problems", IEEE TPDS 6(2), 1995),
# shrinking hi to the attained bottleneck after each success, until lo and hi are adjacent
# floats: no partition is better than the one returned, in the probe's arithmetic.


@dataclass(frozen=True)
class ChainCosts:
    """Everything the chain solver needs, as arrays over cut positions 0..n."""

    num_stages: int
    stage_prefix: Callable[[int], np.ndarray]
    """X_k for stage k; stages with equal speed should return the same array object."""
    cut: np.ndarray
    """Seconds to move the tensor crossing each cut; zeros when communication is free."""
    stage_memory_prefix: Callable[[int], np.ndarray] | None = None
    """M_k for stage k, or None without a memory cap."""
    memory_cap: float | None = None
    balance_prefix: np.ndarray | None = None
    """Prefix used only to break ties evenly (default: X_0)."""
    balance_shares: np.ndarray | None = None
    """Relative share of each stage when breaking ties (default: equal)."""


def window_max(values: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """``max(values[starts[i]:stops[i]])`` for every i (-inf when empty), with a sparse
    table: level j holds the maxima of all windows of length 2**j."""
    result = np.full(len(starts), -np.inf)
    lengths = stops - starts
    valid = lengths > 0
    if not valid.any():
        return result
    # frexp gives x = m * 2**e with 0.5 <= m < 1, so floor(log2(x)) = e - 1, exactly.
    levels = np.zeros(len(starts), dtype=np.int64)
    levels[valid] = np.frexp(lengths[valid].astype(np.float64))[1] - 1
    table = values
    for level in range(int(levels.max()) + 1):
        if level > 0:
            half = 1 << (level - 1)
            table = np.maximum(table[:-half], table[half:])
        chosen = valid & (levels == level)
        if chosen.any():
            first, last = starts[chosen], stops[chosen] - (1 << level)
            result[chosen] = np.maximum(table[first], table[last])
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
    """PROBE(B) for one `ChainCosts`, caching per-stage arrays shared between stages."""

    def __init__(self, costs: ChainCosts) -> None:
        self.costs = costs
        self.num_layers = len(costs.cut) - 1
        self.positions = np.arange(self.num_layers + 1)
        self._separated: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._starts: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def separated(self, stage: int) -> tuple[np.ndarray, np.ndarray]:
        """(g_k, h_k) for stage k."""
        prefix = self.costs.stage_prefix(stage)
        if id(prefix) not in self._separated:
            # The tuple keeps `prefix` alive so its id cannot be reused.
            self._separated[id(prefix)] = (prefix, prefix - self.costs.cut, prefix + self.costs.cut)
        _, g, h = self._separated[id(prefix)]
        return g, h

    def memory_starts(self, stage: int) -> np.ndarray | None:
        """lo_k: for each stop b, the first start a with M_k[b] <= M_k[a] + cap."""
        if self.costs.stage_memory_prefix is None or self.costs.memory_cap is None:
            return None
        memory = self.costs.stage_memory_prefix(stage)
        if id(memory) not in self._starts:
            # memory + cap is sorted (float addition is monotone), so this search answers
            # "first a with M[b] <= M[a] + cap" exactly, with no subtraction.
            starts = np.searchsorted(memory + self.costs.memory_cap, memory, side="left")
            self._starts[id(memory)] = (memory, starts)
        return self._starts[id(memory)][1]

    def reachable(self, bound: float) -> list[np.ndarray] | None:
        """[R_0, ..., R_p] as boolean masks over cut positions, or None if n is not in R_p."""
        n, p = self.num_layers, self.costs.num_stages
        reach = np.zeros(n + 1, dtype=bool)
        reach[0] = True
        sets = [reach]
        for stage in range(p):
            g, h = self.separated(stage)
            masked = np.where(reach, g, -np.inf)
            starts = self.memory_starts(stage)
            if starts is None:
                best = np.empty(n + 1)
                best[0] = -np.inf
                np.maximum.accumulate(masked[:-1], out=best[1:])
            else:
                best = window_max(masked, starts, self.positions)
            reach = (best > -np.inf) & (best >= h - bound)
            # Each later stage needs at least one layer of its own.
            reach[n - (p - 1 - stage) + 1 :] = False
            if not reach.any():
                return None
            sets.append(reach)
        return sets if reach[n] else None

    def extract(self, sets: list[np.ndarray], bound: float) -> tuple[int, ...]:
        """A partition through the reachable sets: from the end, pick for each stage a start
        in R_k that reaches the current stop (the same test as the forward pass, so one
        exists), nearest an even share of what is left."""
        p = self.costs.num_stages
        balance = self.costs.balance_prefix
        if balance is None:
            balance = self.costs.stage_prefix(0)
        shares = self.costs.balance_shares
        if shares is None:
            shares = np.ones(p)
        cuts, stop = [self.num_layers], self.num_layers
        for stage in range(p - 1, 0, -1):
            g, h = self.separated(stage)
            fits = sets[stage][:stop] & (g[:stop] >= h[stop] - bound)
            starts = self.memory_starts(stage)
            if starts is not None:
                fits[: starts[stop]] = False
            candidates = np.flatnonzero(fits)
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
            g, h = self.separated(stage)
            worst = max(worst, float(h[boundaries[stage + 1]] - g[boundaries[stage]]))
        return worst


def _midpoint(low: float, high: float) -> float:
    """The float halfway between two non-negative floats in bit-pattern order."""
    low_bits = int(np.float64(low).view(np.int64))
    high_bits = int(np.float64(high).view(np.int64))
    return float(np.int64((low_bits + high_bits) // 2).view(np.float64))


def solve_chain(costs: ChainCosts) -> tuple[tuple[int, ...], float] | None:
    """Optimal boundaries and bottleneck for a chain with stage- and cut-dependent costs, or
    None when no partition fits the memory cap. O(p * n) per probe (O(p * n log n) with a
    memory cap) times at most 64 probes."""
    probe = _Probe(costs)
    sets = probe.reachable(math.inf)
    if sets is None:
        return None
    best = probe.extract(sets, math.inf)
    lo, hi = 0.0, probe.bottleneck(best)
    sets = probe.reachable(lo)
    if sets is not None:
        best = probe.extract(sets, lo)
        return best, probe.bottleneck(best)
    # Invariant: PROBE(lo) fails and `best` attains a bottleneck <= hi. Bisecting the bit
    # patterns of non-negative doubles (ordered like their values) halves the floats left
    # in (lo, hi) each step: at most 64 probes, ending at adjacent floats.
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
