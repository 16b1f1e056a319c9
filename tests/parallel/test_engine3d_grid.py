"""The full grid: pp2 × dp2 × tp2 on 8 processes, with ZeRO-1, a vocab-parallel embedding tied to
the output head across the first and last stage, tp transformer blocks and global-norm
clipping, equals one process after two Adam steps (loss, every gradient, every parameter)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pipeline import launch
from tests.support.engine3d_models import GRID_CASE, run_case

pytestmark = pytest.mark.multiprocess

TOLERANCE = 2e-5


def _grid_rank() -> dict[str, Any]:
    torch.manual_seed(0)
    return run_case(GRID_CASE)


def test_pp2_dp2_tp2_zero1_tied_equals_one_process() -> None:
    per_rank = launch(_grid_rank, 8, timeout=90, join_timeout=240)
    problems = [f"rank {result['rank']}: {key} differs by {result[key]:.3g}"
                for result in per_rank for key in ("loss", "grad", "param", "norm")
                if result.get(key, 0.0) > TOLERANCE]
    assert not problems, "\n".join(problems)
    for result in per_rank:
        assert result["clipped"]
        assert 0 < result["state_bytes"] <= (result["unsharded_state_bytes"] / result["dp"]
                                             + result["bucket_bytes"])
