"""Leave-one-out on Megatron-LM SC'21 Table 1: the one constant fitted to it refitted on nine
rows, the tenth scored with it.

The A100 presets' GEMM tile efficiency (`pipeline.planner.cluster._DEVICE_MODEL`, 0.70: the
share of an SM's peak a full 256 × 128 tile reaches) is the only figure calibrated against
Table 1 (`bench_published.py`); the element-wise and link efficiencies and the kernel cost
are device figures (set in the pass that first compared with Table 1, not refitted here;
`term_sensitivity.py` shows what each moves). For each row r, the efficiency that
minimises the sum of squared log ratios (predicted / published TFLOP/s) over the other nine
rows is found on a grid, and row r is priced with it: its leave-one-out ratio. Issue 48's
target: within ±5 % on at least 8 of the 10 rows.

    PYTHONPATH=. python benchmarks/table1_loo.py
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from benchmarks.bench_published import MEGATRON_2021, ROWS, PublishedRow, _model, paper_flops
from pipeline.planner import PRESETS, SearchOptions
from pipeline.planner.search import price

__all__ = ["GRID", "HeldOut", "fit_efficiency", "leave_one_out", "loo_lines", "row_ratio"]

GRID = tuple(round(0.55 + 0.0025 * i, 4) for i in range(121))
"""GEMM tile efficiencies tried: 0.55 to 0.85 in steps of 0.0025 (a step moves a row's
ratio by about 0.35 %)."""
TARGET = 0.05


@dataclass(frozen=True)
class HeldOut:
    """One row scored with the efficiency fitted on the others."""

    index: int
    efficiency: float
    """GEMM tile efficiency fitted on the other rows."""
    ratio: float
    """Predicted / published TFLOP/s of the held-out row at that efficiency."""


def row_ratio(row: PublishedRow, gemm_efficiency: float) -> float:
    """Predicted / published TFLOP/s per GPU of the paper's own configuration of `row` on
    `a100-80g` with the GEMM tile efficiency set to `gemm_efficiency`."""
    cluster = replace(PRESETS["a100-80g"], nodes=row.gpus // 8, gemm_efficiency=gemm_efficiency)
    found = price(_model(row), cluster, row.batch, row.config(), precision="fp16",
                  options=SearchOptions(**MEGATRON_2021))
    return paper_flops(row) / found.step_seconds / row.gpus / 1e12 / row.tflops


def fit_efficiency(ratio: Callable[[int, float], float], indices: Sequence[int],
                   grid: Sequence[float] = GRID) -> float:
    """The grid value minimising Σ log²(ratio(i, e)) over the rows `indices` (ties: the
    smaller value)."""
    if not indices or not grid:
        raise ValueError(f"fit_efficiency needs rows and a grid, got {list(indices)} and "
                         f"{list(grid)}")
    return min(grid, key=lambda e: (sum(math.log(ratio(i, e)) ** 2 for i in indices), e))


def leave_one_out(ratio: Callable[[int, float], float], count: int,
                  grid: Sequence[float] = GRID) -> list[HeldOut]:
    """For each of `count` rows: the efficiency fitted on the others, and the row's ratio
    at it."""
    if count < 2:
        raise ValueError(f"leave-one-out needs at least 2 rows, got {count}")
    held = []
    for index in range(count):
        efficiency = fit_efficiency(ratio, [i for i in range(count) if i != index], grid)
        held.append(HeldOut(index, efficiency, ratio(index, efficiency)))
    return held


def _cached_ratio(rows: Sequence[PublishedRow]) -> Callable[[int, float], float]:
    cache: dict[tuple[int, float], float] = {}

    def ratio(index: int, efficiency: float) -> float:
        key = (index, efficiency)
        if key not in cache:
            cache[key] = row_ratio(rows[index], efficiency)
        return cache[key]

    return ratio


def loo_lines(rows: Sequence[PublishedRow] = ROWS, grid: Sequence[float] = GRID) -> list[str]:
    """The per-row table, then how many rows are within ±5 %."""
    ratio = _cached_ratio(rows)
    full = fit_efficiency(ratio, range(len(rows)), grid)
    lines = ["Table 1 leave-one-out: GEMM tile efficiency fitted on the other nine rows",
             f"(all ten rows fit {full:.4f}; the preset has "
             f"{PRESETS['a100-80g'].gemm_efficiency})", "",
             "| model | paper's run | paper TFLOP/s | fitted on the others | LOO ratio | "
             "LOO error | ratio at the preset |", "|---|---|---:|---:|---:|---:|---:|"]
    preset = PRESETS["a100-80g"].gemm_efficiency
    within = 0
    for held in leave_one_out(ratio, len(rows), grid):
        row = rows[held.index]
        within += abs(held.ratio - 1) <= TARGET
        v = f" v{row.chunks}" if row.chunks > 1 else ""
        lines.append(f"| {row.billions}B | t{row.tp} p{row.pp} b{row.microbatch}{v} | "
                     f"{row.tflops:.0f} | {held.efficiency:.4f} | {held.ratio:.3f} | "
                     f"{held.ratio - 1:+.1%} | {row_ratio(row, preset):.3f} |")
    lines += ["", f"rows within ±{TARGET:.0%} leave-one-out: {within} of {len(rows)} -> "
                  f"{'met' if within >= 8 else 'NOT met'} (target >= 8 of 10)"]
    return lines


if __name__ == "__main__":
    print("\n".join(loo_lines()))
