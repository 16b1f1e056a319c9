"""Table 1 leave-one-out (issue 48, "calibrate honestly"): the refit on nine rows never sees
the tenth, the fit is the least-squares one in log ratio, and a real row's ratio moves with
the GEMM tile efficiency as the kernel model says it must."""

from __future__ import annotations

import math

import pytest

from benchmarks.table1_loo import GRID, fit_efficiency, leave_one_out, row_ratio

__all__: list[str] = []

# Synthetic rows: row i's ratio is e / truth[i] (the prediction proportional to the
# efficiency), so the log-least-squares fit over rows S is the geometric mean of truth[S].
TRUTH = (0.66, 0.68, 0.70, 0.72, 0.74, 0.95)
FINE = tuple(round(0.5 + 0.0001 * i, 4) for i in range(5001))


def _ratio(index: int, efficiency: float) -> float:
    return efficiency / TRUTH[index]


def _geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def test_fit_is_the_log_least_squares_optimum() -> None:
    rows = [0, 1, 2, 3]
    assert fit_efficiency(_ratio, rows, FINE) == pytest.approx(
        _geometric_mean([TRUTH[i] for i in rows]), abs=1e-4)


def test_each_held_out_row_is_scored_with_a_fit_that_never_saw_it() -> None:
    held = leave_one_out(_ratio, len(TRUTH), FINE)
    for out in held:
        others = [t for i, t in enumerate(TRUTH) if i != out.index]
        assert out.efficiency == pytest.approx(_geometric_mean(others), abs=1e-4)
        assert out.ratio == pytest.approx(out.efficiency / TRUTH[out.index])
    # the outlier (0.95) scored on the others' fit is far off; in its own fit it would not be
    assert held[-1].ratio < 0.76
    assert held[0].efficiency > held[-1].efficiency


def test_a_fit_that_sees_the_held_out_row_fails_the_oracle() -> None:
    """Planted bug: fitting on every row (the held-out one included) before scoring."""
    leaky = fit_efficiency(_ratio, range(len(TRUTH)), FINE)
    honest = leave_one_out(_ratio, len(TRUTH), FINE)[-1].efficiency
    assert abs(leaky - honest) > 0.02


def test_refusals_name_the_values() -> None:
    with pytest.raises(ValueError, match="at least 2 rows, got 1"):
        leave_one_out(_ratio, 1, FINE)
    with pytest.raises(ValueError, match="needs rows and a grid"):
        fit_efficiency(_ratio, [], FINE)


def test_grid_spans_the_preset_and_a_real_row_scales_with_the_efficiency() -> None:
    from benchmarks.bench_published import ROWS

    assert GRID[0] < 0.70 < GRID[-1]
    row = ROWS[7]  # 310.1B, t8 p16: compute-bound, so throughput ∝ GEMM efficiency there
    low, high = row_ratio(row, 0.65), row_ratio(row, 0.75)
    assert 1 < high / low < 0.75 / 0.65
