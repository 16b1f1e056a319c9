"""Steps that used to train silently wrong are refused before the first instruction, and a
NaN/inf is reported where it first appeared, with no weight updated."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from pipeline import (
    NonFiniteError,
    PipelineConfigError,
    PipelineEngine,
    PipelineModule,
    launch,
)
from tests.support.pipeline_models import MODELS, WIDTH


def _module() -> PipelineModule:
    return PipelineModule(MODELS["mlp"].layers(), num_stages=2, loss_fn=MODELS["mlp"].loss)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _weights(engine: PipelineEngine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def _outcome(call: Any) -> str:
    try:
        call()
    except (PipelineConfigError, NonFiniteError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "accepted"


def _scenarios() -> dict[str, Any]:
    seen: dict[str, Any] = {}
    x, y = MODELS["mlp"].batch(seed=0, batch=8)
    engine = PipelineEngine(_module(), schedule="1f1b", num_microbatches=4, optimizer=_sgd)
    # regression: targets of 4 samples broadcast against 8 inputs trained on a wrong loss
    seen["batch sizes 8 vs 4"] = _outcome(lambda: engine.train_batch(x, y[:4]))
    # regression: an empty batch gave a NaN loss
    seen["empty batch"] = _outcome(lambda: engine.train_batch(x[:0], y[:0]))
    # regression: a factory returning None trained nothing
    seen["factory returns None"] = _outcome(
        lambda: PipelineEngine(_module(), schedule="1f1b", num_microbatches=4,
                               optimizer=lambda params: None))
    # NaN in microbatch 1's inputs: stage 0's output is where it first appears
    poisoned = x.clone()
    poisoned[2:4] = math.nan
    before = _weights(engine)
    seen["nan input"] = _outcome(lambda: engine.train_batch(poisoned, y))
    seen["nan input: weights kept"] = all(torch.equal(a, b)
                                          for a, b in zip(before, _weights(engine)))
    # a NaN target: the loss of the last stage, microbatch 3
    bad_targets = y.clone()
    bad_targets[6:] = math.nan
    seen["nan target"] = _outcome(lambda: engine.train_batch(x, bad_targets))
    # skip: the step goes by, weights unchanged, the next clean step trains
    skipping = PipelineEngine(_module(), schedule="1f1b", num_microbatches=4, optimizer=_sgd,
                              on_nonfinite="skip")
    before = _weights(skipping)
    loss = skipping.train_batch(poisoned, y)
    seen["skip"] = (math.isnan(loss), skipping.last_step_skipped,
                    all(torch.equal(a, b) for a, b in zip(before, _weights(skipping))))
    clean = skipping.train_batch(x, y)
    seen["after skip"] = (math.isfinite(clean), skipping.last_step_skipped,
                          any(not torch.equal(a, b) for a, b in zip(before,
                                                                    _weights(skipping))))
    seen["engine still runs"] = math.isfinite(engine.train_batch(x, y))
    return seen


@pytest.mark.multiprocess
def test_silent_steps_are_refused_on_every_rank() -> None:
    for rank, seen in enumerate(launch(_scenarios, 2, timeout=30, join_timeout=180)):
        assert "inputs hold 8 samples but targets 4" in seen["batch sizes 8 vs 4"], (rank, seen)
        empty = seen["empty batch"]  # each rank names its own empty part (inputs / targets)
        assert f"{('inputs', 'targets')[rank]} is an empty batch (0 samples" in empty, empty
        assert seen["factory returns None"].startswith("TypeError: the optimizer factory "
                                                       "returned None"), seen
        nan_input = seen["nan input"]
        assert nan_input.startswith("NonFiniteError") and \
            "the output of stage 0, microbatch 1" in nan_input and \
            "skipped on every rank" in nan_input, nan_input
        assert seen["nan input: weights kept"]
        assert "the loss of stage 1, microbatch 3" in seen["nan target"], seen["nan target"]
        assert seen["skip"] == (True, True, True)
        assert seen["after skip"] == (True, False, True)
        assert seen["engine still runs"]


def test_a_layer_class_is_refused_with_the_fix() -> None:
    # regression: nn.Linear (the class) is callable, so it was accepted as a layer
    with pytest.raises(TypeError, match=r"layer 1: the class Linear \(pass an instance "
                       r"Linear\(...\) or LayerSpec\(Linear, ...\)\)"):
        PipelineModule([nn.Linear(WIDTH, WIDTH), nn.Linear], num_stages=1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda_is_refused_before_anything_runs() -> None:
    # regression: device="cuda" without CUDA ended in a bare AssertionError
    with pytest.raises(PipelineConfigError, match=r"device=cuda but this machine has no CUDA "
                       r"device; omit device"):
        PipelineEngine(_module(), schedule="1f1b", num_microbatches=2,
                       device=torch.device("cuda"))


def test_a_million_microbatches_is_refused_before_anything_is_built() -> None:
    # regression: num_microbatches=10**6 killed a rank with no message
    from pipeline.runtime.schedule_setup import resolve_schedule

    with pytest.raises(PipelineConfigError, match=r"cannot build schedule '1f1b'.*limit"):
        resolve_schedule("1f1b", _module(), 10**6)
