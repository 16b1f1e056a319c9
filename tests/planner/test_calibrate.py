"""Profiling layers and calibrating this machine (torch; the calibration spawns 2 ranks)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.planner import PRESETS, LayerProfile, PlanError, SearchOptions, plan
from pipeline.planner.calibrate import calibrate_local, profile_layers
from pipeline.planner.pricing import layer_split_times, layer_times, layer_tp_seconds

__all__: list[str] = []


def test_profiled_layers_count_parameters_outputs_and_saved_bytes() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)]
    model = profile_layers(layers, lambda b: torch.randn(b, 16), batches=(1, 4), repeats=2)
    first, gelu, last = model.layers
    assert first.params(1) == 16 * 32 + 32 and last.params(1) == 32 * 8 + 8
    assert gelu.params(1) == 0
    assert first.output_bytes == 32 * 4 and last.output_bytes == 8 * 4
    assert last.input_bytes == gelu.output_bytes
    # a Linear saves its input for the weight gradient: 16 floats per sample
    assert first.held(1) == pytest.approx(16 * 4)
    assert all(layer.measured and layer.split_seconds is not None for layer in model.layers)
    assert not model.tensor_parallel_ok


def test_profiled_models_plan_without_tensor_parallel() -> None:
    layers = [nn.Linear(16, 16) for _ in range(4)]
    model = profile_layers(layers, lambda b: torch.randn(b, 16), batches=(1, 2), repeats=1)
    result = plan(model, PRESETS["a100-80g"], 8, precision="fp32",
                  options=SearchOptions(max_chunks=2))
    assert {p.config.tp for p in result.predictions} == {1}


def test_split_times_default_to_half_the_backward_each() -> None:
    layer = LayerProfile(name="x", flops_split=1e12, tp_allreduces=2, tp_allreduce_bytes=1e6)
    cluster = PRESETS["a100-80g"]
    _, backward = layer_times(layer, cluster, "bf16", 2, 4)
    input_grad, weight_grad = layer_split_times(layer, cluster, "bf16", 2, 4)
    assert input_grad + weight_grad == pytest.approx(backward)
    assert input_grad - weight_grad == pytest.approx(layer_tp_seconds(layer, cluster, 2, 4))


def test_profile_needs_two_batch_sizes() -> None:
    with pytest.raises(PlanError, match="two different sizes"):
        profile_layers([nn.Linear(2, 2)], lambda b: torch.randn(b, 2), batches=(2, 2))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_local_calibration_measures_positive_figures() -> None:
    spec = calibrate_local(ranks=2)
    assert spec.num_devices == 2 and spec.precision == "fp32"
    assert spec.peak_flops["fp32"] > 0 and spec.intra_bandwidth > 0
    assert spec.op_overhead > 0 and spec.device_memory > 0
