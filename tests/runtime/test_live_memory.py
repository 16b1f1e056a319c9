"""`LiveTensorMeter` counts the bytes of known tensors exactly: once per storage, until freed,
split into states / saved activations / other, and remembers the split at the peak."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.runtime.live_memory import LiveSplit, LiveTensorMeter


def _nbytes(*tensors: torch.Tensor) -> int:
    """The oracle: elements × element size of each tensor (each owns its storage)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def test_counts_each_storage_once_until_it_is_freed() -> None:
    with LiveTensorMeter() as meter:
        a = torch.zeros(1000)
        b = torch.ones(10, 7, dtype=torch.bfloat16)
        assert meter.live == LiveSplit(0, 0, _nbytes(a, b))  # the meter kept no handle alive
        view, part = a.view(10, 100), a[5:20]
        assert meter.live.total == _nbytes(a, b)  # views share their base's storage
        del a, view
        assert meter.live.total == _nbytes(torch.empty(1000)) + _nbytes(b)  # `part` holds it
        del part
        assert meter.live.total == _nbytes(b)
        del b
        assert meter.live.total == 0


def test_storage_swapped_out_by_data_assignment_is_uncounted() -> None:
    # both engines free a tensor's memory this way (Megatron's deallocate_output_tensor)
    with LiveTensorMeter() as meter:
        output = torch.randn(64, 32)
        output.data = torch.empty(1)
        assert meter.live.total == 4


def test_tensors_made_outside_are_not_counted() -> None:
    outside = torch.zeros(100)
    with LiveTensorMeter() as meter:
        inside = torch.zeros(3)
        assert meter.live.total == _nbytes(inside)
    assert outside.numel() == 100


def test_peak_is_the_largest_total_with_its_split() -> None:
    with LiveTensorMeter() as meter:
        weight = torch.randn(32, 16, requires_grad=True)
        meter.begin_step()
        assert meter.peak == LiveSplit(_nbytes(weight), 0, 0)
        x = torch.randn(8, 32)
        y = x @ weight  # mm saves x (for weight's gradient) and weight (a state)
        saved = _nbytes(x)
        assert meter.live == LiveSplit(_nbytes(weight), saved, _nbytes(y))
        del x  # autograd still holds it: still an activation
        assert meter.live == LiveSplit(_nbytes(weight), saved, _nbytes(y))
        y.sum().backward()  # the graph and its saved x go; weight.grad is made in the step
        assert weight.grad is not None
        assert meter.live == LiveSplit(_nbytes(weight), 0, _nbytes(y, weight.grad))
        # at the peak x was still saved while weight.grad, y, sum's output and its
        # gradient (one float each) were alive; y's gradient is that float expanded, a view
        assert meter.peak == LiveSplit(_nbytes(weight), saved, _nbytes(y, weight.grad) + 2 * 4)
        del y
        meter.begin_step()  # what is alive now (weight and its gradient) is state
        assert meter.peak == meter.live == LiveSplit(_nbytes(weight, weight.grad), 0, 0)


def test_labels_name_what_the_peak_is_made_of() -> None:
    with LiveTensorMeter(labels=True) as meter:
        kept = torch.zeros(256)
        dropped = torch.ones(64, dtype=torch.bfloat16)
        del dropped
        torch.ones(8)
    assert meter.peak_labels == {"other torch.float32 aten.zeros.default": _nbytes(kept),
                                 "other torch.bfloat16 aten.ones.default": 128}


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None,
                    reason="DeepSpeed is installed: the benchmark would run it")
def test_deepspeed_memory_benchmark_says_it_skipped_without_deepspeed() -> None:
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_memory_deepspeed.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, check=True)
    assert "DeepSpeed not installed: skipped" in done.stdout
