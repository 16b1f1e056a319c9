"""ZeRO-2 / 3 on the 8-process pp2 × dp2 × tp2 grid: a tiny HF Llama split by
`tensor_parallel_hf` (1F1B, ZB-V) against HF, and tied tp layers with Adam and clipping
against the single-process reference."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline import launch
from tests.support.engine3d_models import Case, run_case
from tests.support.hf_tp_equivalence import TPCase, tp_step_errors

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

HF_CASES = [TPCase("llama", tp=2, dp=2, zero=3),
            TPCase("llama", tp=2, dp=2, zero=2, schedule="zb-v", chunks=2),
            TPCase("llama", tp=2, dp=2, zero=3, schedule="zb-v", chunks=2)]
TIED_CASES = [Case(f"pp2×dp2×tp2 ZeRO-{zero} tied Adam +clip", "tied-tp",
                   {"data_parallel": 2, "tensor_parallel": 2, "zero_stage": zero,
                    "gradient_clipping": 0.05}, optimizer="adam") for zero in (2, 3)]


def _grid() -> dict[str, Any]:
    return {"hf": [(case.label(), tp_step_errors(case)) for case in HF_CASES],
            "tied": [run_case(case) for case in TIED_CASES]}


def test_zero_2_and_3_with_tensor_parallel_equal_one_process() -> None:
    for outcome in launch(_grid, 8, timeout=120, join_timeout=1200):
        for label, errors in outcome["hf"]:  # relative errors, one SGD step
            assert errors["sharded"] == 1.0, label  # tp really split the layers
            for what in ("loss", "grad", "param"):
                assert errors[what] < 1e-5, (label, what, errors[what])
        for result in outcome["tied"]:  # absolute, two Adam steps
            for what in ("loss", "grad", "param", "norm"):
                assert result.get(what, 0.0) < 2e-5, (result["case"], what, result.get(what))
            assert result["clipped"], result["case"]
