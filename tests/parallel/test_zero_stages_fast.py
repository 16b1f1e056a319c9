"""The fast tier's proof of ZeRO-2 and ZeRO-3 (docs/testing.md): one 4-process launch, a tiny
HF Llama at pp2 × dp2 under ZB-V (split backward: ZeRO-3 gathers for I and W) against HF,
each stage once; tests/parallel/test_zero_stages.py holds every schedule and option."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline import launch
from tests.support.zero_equivalence import zero_differences

pytestmark = [pytest.mark.multiprocess, pytest.mark.fast]

TOLERANCE = 1e-5


def _both() -> list[dict[str, Any]]:
    return [{"stage": stage, **zero_differences(stage, "zb-v", 2)} for stage in (2, 3)]


def test_zero_2_and_3_under_zb_v_equal_hf() -> None:
    for rank, results in enumerate(launch(_both, 4, timeout=60, join_timeout=600)):
        for result in results:
            for what in ("loss", "grad", "param"):
                assert result[what] < TOLERANCE, (rank, result["stage"], what, result[what])
