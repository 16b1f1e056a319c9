"""The fast tier's proof of ZeRO-2 and ZeRO-3 (docs/testing.md): one 4-process launch, a tiny
HF Llama at pp2 × dp2 under ZB-V (split backward: ZeRO-3 gathers for I and W) against HF,
each stage once, and a tiny Mixtral with ZeRO-3 at ep 2; tests/parallel/test_zero_stages.py
and test_zero_stages_moe.py hold every schedule and option."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pipeline import launch
from tests.support.hf_moe_equivalence import moe_step_differences
from tests.support.zero_equivalence import zero_differences

pytestmark = [pytest.mark.multiprocess, pytest.mark.fast]

TOLERANCE = 1e-5
"""Absolute for the Llama runs, relative for Mixtral's (`moe_step_differences`)."""
WHAT = ("loss", "grad", "param")


def _both() -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    runs = [{"stage": stage, **zero_differences(stage, "zb-v", 2)} for stage in (2, 3)]
    moe = moe_step_differences("mixtral", pp=2, dp=2, ep=2, zero=3, schedule="zb-v", chunks=2)
    return [*runs, {"stage": "3, Mixtral ep2", **{what: moe[what] for what in WHAT}}]


def test_zero_2_and_3_under_zb_v_equal_hf() -> None:
    for rank, results in enumerate(launch(_both, 4, timeout=60, join_timeout=600)):
        for result in results:
            for what in WHAT:
                assert result[what] < TOLERANCE, (rank, result["stage"], what, result[what])
