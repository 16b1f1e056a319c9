"""The per-output finiteness flag is exact and allocates nothing the size of the output (it was
`isfinite(t).all()`: an abs copy and three bool tensors of the output's size at the forward's
peak)."""

from __future__ import annotations

import pytest
import torch

from pipeline.runtime.finite import all_finite
from pipeline.runtime.live_memory import LiveTensorMeter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16,
                                   torch.float64])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, 5, -1])
def test_all_finite_agrees_with_isfinite(dtype: torch.dtype, bad: float | None,
                                         where: int) -> None:
    tensor = torch.randn(4, 3).to(dtype)
    if bad is not None:
        tensor.view(-1)[where] = bad
    expected = bool(torch.isfinite(tensor).all())  # the oracle: the definition
    assert bool(all_finite(tensor)) == expected
    assert bool(all_finite((torch.ones(2), tensor))) == expected
    assert bool(all_finite(torch.empty(0, 3, dtype=dtype)))


def test_all_finite_allocates_nothing_the_size_of_the_output() -> None:
    with LiveTensorMeter() as meter:
        out = torch.randn(256, 512, dtype=torch.bfloat16)
        meter.begin_step()
        flag = all_finite(out)
        assert bool(flag)
    # a few 0-dim results; unfixed: abs (bf16, 256 KiB) + three bool tensors (128 KiB each)
    assert meter.peak.total - meter.peak.states <= 64, meter.peak
