"""Exact min-max partitioning of a DAG in a fixed topological order, by dynamic programming."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from partition.parametric import choose_cut
from partition.prefix_sums import LinearPrefix

__all__ = ["DagCosts", "solve_dag"]

# Legend: n layers in topological order, p stages, stage k covers positions [a, b); every
# edge (u, v) has u < v and costs s_uv seconds to move, paid by both ends when it crosses a
# cut.
#   X_k          prefix of stage k's compute time (compute / speed of stage k)
#   M_k          prefix of stage k's memory
#   cross[c]     sum of s_uv over edges with u < c <= v (the edges cut c severs)
#   J(a, b)      sum of s_uv over edges with u < a and v >= b (they jump over [a, b))
#   comm(a, b)   = cross[a] + cross[b] - 2 J(a, b): the edges with exactly one end in
#                [a, b); an edge jumping the whole stage is in both cross terms but has no
#                end in the stage, hence the -2J.
#   T_k(a, b)    = X_k[b] - X_k[a] + comm(a, b)
#
# Recurrence (the classic linear-partition DP, e.g. Skiena, The Algorithm Design Manual,
# section 8.5, with max in place of sum):
#   F[0][0] = 0, F[0][a > 0] = inf
#   F[k+1][b] = min over a < b with M_k[b] <= M_k[a] + cap of max(F[k][a], T_k(a, b))
# F[p][n] is the optimal bottleneck. J(., b) is not separable into a-only and b-only terms,
# which is why the chain probe does not apply; the DP is O(p * n^2) time, O(p * n) memory,
# vectorised over (k, a) for each b.


@dataclass(frozen=True)
class DagCosts:
    """Everything the DAG solver needs, as arrays over positions 0..n."""

    num_layers: int
    compute: LinearPrefix
    """X_k, the prefix of stage k's compute time."""
    edge_source: np.ndarray
    edge_target: np.ndarray
    edge_seconds: np.ndarray
    memory: LinearPrefix | None = None
    """M_k, the prefix of stage k's memory, or None without a cap."""
    memory_cap: float | None = None
    balance_prefix: np.ndarray | None = None
    balance_shares: np.ndarray | None = None


class _Tables:
    """Per-stage prefix matrices and the edge bookkeeping for comm(a, b)."""

    def __init__(self, costs: DagCosts) -> None:
        n, p = costs.num_layers, costs.compute.num_stages
        self.costs = costs
        self.compute = np.stack([costs.compute.full(stage) for stage in range(p)])
        self.memory: np.ndarray | None = None
        if costs.memory is not None and costs.memory_cap is not None:
            self.memory = np.stack([costs.memory.full(stage) for stage in range(p)])
        order = np.argsort(costs.edge_target, kind="stable")
        self.source = costs.edge_source[order]
        self.target = costs.edge_target[order]
        self.seconds = costs.edge_seconds[order]
        delta = np.zeros(n + 2)
        np.add.at(delta, self.source + 1, self.seconds)
        np.add.at(delta, self.target + 1, -self.seconds)
        self.cross = np.cumsum(delta)[: n + 1]

    def comm(self, stop: int) -> np.ndarray:
        """comm(a, stop) for every a in 0..stop-1."""
        n = self.costs.num_layers
        first = int(np.searchsorted(self.target, stop, side="left"))
        # Seconds leaving each layer u towards positions >= stop.
        leaving = np.bincount(self.source[first:], weights=self.seconds[first:], minlength=n)
        jump = np.zeros(stop)
        np.cumsum(leaving[: stop - 1], out=jump[1:])
        return self.cross[:stop] + self.cross[stop] - 2.0 * jump

    def stage_times(self, stop: int) -> np.ndarray:
        """T_k(a, stop) for every stage k (rows) and start a < stop (columns)."""
        return self.compute[:, stop, None] - self.compute[:, :stop] + self.comm(stop)

    def over_cap(self, stop: int) -> np.ndarray | None:
        """Mask of (k, a) whose stage [a, stop) exceeds the memory cap."""
        if self.memory is None or self.costs.memory_cap is None:
            return None
        return self.memory[:, stop, None] > self.memory[:, :stop] + self.costs.memory_cap


def solve_dag(costs: DagCosts) -> tuple[tuple[int, ...], float] | None:
    """Optimal boundaries and bottleneck for a DAG in topological order, or None when no
    partition fits the memory cap."""
    n, p = costs.num_layers, costs.compute.num_stages
    tables = _Tables(costs)
    best = np.full((p + 1, n + 1), np.inf)
    best[0, 0] = 0.0
    for stop in range(1, n + 1):
        candidates = np.maximum(best[:p, :stop], tables.stage_times(stop))
        over = tables.over_cap(stop)
        if over is not None:
            candidates[over] = np.inf
        best[1:, stop] = candidates.min(axis=1)
    bottleneck = float(best[p, n])
    if not np.isfinite(bottleneck):
        return None
    return _extract(tables, best, bottleneck), bottleneck


def _extract(tables: _Tables, best: np.ndarray, bottleneck: float) -> tuple[int, ...]:
    """Walk back from (p, n), choosing among starts that keep the optimum the one nearest
    an even share of what is left."""
    costs = tables.costs
    p = costs.compute.num_stages
    balance = costs.balance_prefix if costs.balance_prefix is not None else tables.compute[0]
    shares = costs.balance_shares if costs.balance_shares is not None else np.ones(p)
    cuts, stop = [costs.num_layers], costs.num_layers
    for stage in range(p - 1, 0, -1):
        times = tables.stage_times(stop)[stage]
        fits = (best[stage, :stop] <= bottleneck) & (times <= bottleneck)
        over = tables.over_cap(stop)
        if over is not None:
            fits &= ~over[stage]
        candidates = np.flatnonzero(fits)
        if candidates.size == 0:
            raise RuntimeError(f"internal error: stage {stage} has no start under {bottleneck!r}")
        before = float(shares[:stage].sum())
        stop = choose_cut(candidates, balance, stop, before / (before + float(shares[stage])))
        cuts.append(stop)
    cuts.append(0)
    return tuple(reversed(cuts))
