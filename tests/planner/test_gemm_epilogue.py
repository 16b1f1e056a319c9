"""The GEMM epilogue term (issue 48 item 1, GEMM efficiency by shape): on Ampere the output
tile is stored after the k-loop, so a GEMM's time is its k-loop plus its output's bytes at
HBM bandwidth; a GEMM's share lost to it is e·F/(2k·B), the datasheet figures' 130/k on an
A100; Hopper presets are priced as before; Table 1's spread between small and large models
narrows."""

from __future__ import annotations

import math
from dataclasses import replace
from unittest import mock

import pytest

from pipeline.planner import PRESETS, PlanError
from pipeline.planner.kernels import epilogue_seconds, gemm_seconds
from pipeline.planner.roofline import _TILES

__all__: list[str] = []

A100, H100 = PRESETS["a100-80g"], PRESETS["h100-80g"]
A100_FP16, A100_HBM, A100_SMS = 312e12, 2.039e12, 108
"""A100 80GB SXM datasheet (2021): 312 TFLOP/s fp16 dense, 2,039 GB/s HBM2e; 108 SMs."""


def test_epilogue_is_the_output_bytes_at_the_streaming_bandwidth() -> None:
    assert epilogue_seconds(4096, 1024, A100) == pytest.approx(
        4096 * 1024 * 2 / (A100_HBM * 0.85))
    assert epilogue_seconds(64, 64, A100, batch=3, element=4) == pytest.approx(
        3 * 64 * 64 * 4 / (A100_HBM * 0.85))


@pytest.mark.parametrize("k", [2304, 3200, 12800])
def test_a100_gemm_loses_130_over_k_to_its_epilogue(k: int) -> None:
    # 256 × 128 tiles, 12 × 9 = 108 of them a wave (every SM busy), 4 waves
    m, n = 256 * 12 * 4, 128 * 9
    assert A100.gemm_epilogue_serial and A100.sm_count == A100_SMS
    k_loop = 2 * m * n * k / (A100_FP16 * A100.gemm_efficiency)
    seconds = gemm_seconds(m, n, k, A100, "fp16") - A100.kernel_overhead
    share = (seconds - k_loop) / k_loop
    expected = 2 * A100_FP16 * A100.gemm_efficiency / (2 * k * A100_HBM * 0.85)
    assert share == pytest.approx(expected, rel=1e-9)
    assert share == pytest.approx(130 / k, rel=0.01)


def test_hopper_overlaps_the_store_as_before() -> None:
    """The H100 preset: the slower of the tiles' k-loop and all the bytes (the formula the
    kernel model had before the term), so its predictions are unchanged."""
    assert not H100.gemm_epilogue_serial and H100.gemm_efficiency == 0.70
    per_sm = 989e12 / 132 * 0.70
    for m, n, k in ((8192, 8192, 8192), (4096, 128, 4096), (2048, 2048, 128)):
        k_loop = min(math.ceil(math.ceil(m / rows) * math.ceil(n / cols) / 132)
                     * 2 * rows * cols * k / (per_sm * share) for rows, cols, share in _TILES)
        traffic = (m * k + k * n + m * n) * 2 / (3.35e12 * 0.85)
        assert gemm_seconds(m, n, k, H100, "bf16") == pytest.approx(
            max(k_loop, traffic) + H100.kernel_overhead, rel=1e-12)
        # the flag on: the store after the k-loop costs a compute-bound GEMM more
        serial = gemm_seconds(m, n, k, replace(H100, gemm_epilogue_serial=True), "bf16")
        assert serial > gemm_seconds(m, n, k, H100, "bf16") or traffic > k_loop


def test_the_flag_must_be_a_boolean() -> None:
    with pytest.raises(PlanError, match=r"gemm_epilogue_serial='yes' must be true or false"):
        replace(A100, gemm_epilogue_serial="yes")  # type: ignore[arg-type]


def test_table_1_spread_between_the_smallest_and_largest_runs_narrows() -> None:
    """1.7B (t1, k down to 2,304) was priced 10 % faster than 1008B (t8, k 3,200-25,600)
    relative to their published figures: storing the output after the k-loop costs the
    thin-k GEMMs more, so the spread shrinks (each at its own fitted efficiency)."""
    from benchmarks.bench_published import ROWS
    from benchmarks.table1_loo import row_ratio

    small, large = ROWS[0], ROWS[-1]
    new = row_ratio(small, A100.gemm_efficiency) / row_ratio(large, A100.gemm_efficiency)
    old_a100 = replace(A100, gemm_epilogue_serial=False, gemm_efficiency=0.70)
    with mock.patch.dict(PRESETS, {"a100-80g": old_a100}):
        old = row_ratio(small, 0.70) / row_ratio(large, 0.70)
    assert 1 < new < old - 0.03


def test_a_cluster_file_sets_the_flag() -> None:
    from pipeline.planner.cluster import cluster_from_json

    assert cluster_from_json({"preset": "h100-80g", "gemm_epilogue_serial": True}
                             ).gemm_epilogue_serial
    assert not cluster_from_json({"preset": "a100-80g", "gemm_epilogue_serial": False}
                                 ).gemm_epilogue_serial
    with pytest.raises(PlanError, match="gemm_epilogue_serial=1 must be true or false"):
        cluster_from_json({"preset": "a100-80g", "gemm_epilogue_serial": 1})
