"""The engine's optimizer as torch users drive it, on pp2 × dp2, against one process running
plain torch: parameter groups split by ``p.ndim`` (with and without ZeRO-1), torch's LR
schedulers on `engine.optimizer`; and a parameter unfrozen after the engine was built, refused.

One 4-process launch runs every case; each returns this rank's largest parameter error.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline import LayerSpec, PipelineConfigError, PipelineEngine, PipelineModule, launch
from pipeline.model.reference import build_reference, reference_forward
from tests.support.pipeline_models import WIDTH, mlp_batch, mlp_layers

pytestmark = pytest.mark.multiprocess

TOLERANCE = 2e-5
STEPS, BATCH, MICROBATCHES = 3, 16, 4


def _grouped_adamw(params: Any) -> torch.optim.Optimizer:
    """The usual split: weight decay on matrices, none on biases (by the shape the user
    sees: under ZeRO-1 the shards are flat, so a split by shard shape puts all in one)."""
    params = list(params)
    return torch.optim.AdamW([
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.5},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}], lr=0.05)


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.05)


def _step_lr(optimizer: Any) -> Any:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def _named(model: nn.ModuleList) -> dict[tuple[int, str], nn.Parameter]:
    return {(index, name): param for index, layer in enumerate(model)
            for name, param in layer.named_parameters()}


def _reference(factory: Callable[[Any], torch.optim.Optimizer], scheduler: Any
               ) -> dict[tuple[int, str], torch.Tensor]:
    """Plain torch, one process, the full batch: the optimizer holds every parameter."""
    model = build_reference(mlp_layers())
    named = _named(model)
    optimizer = factory(list(model.parameters()))
    schedule = scheduler(optimizer) if scheduler is not None else None
    for step in range(STEPS):
        inputs, targets = mlp_batch(step, BATCH)
        optimizer.zero_grad()
        F.mse_loss(reference_forward(model, inputs), targets).backward()
        optimizer.step()
        if schedule is not None:
            schedule.step()
    return {key: param.detach().clone() for key, param in named.items()}


def _engine_run(factory: Callable[[Any], torch.optim.Optimizer], scheduler: Any,
                zero_stage: int) -> dict[str, Any]:
    module = PipelineModule(mlp_layers(), num_stages=2, loss_fn=F.mse_loss)
    engine = PipelineEngine(module, schedule="1f1b", num_microbatches=MICROBATCHES,
                            optimizer=factory, data_parallel=2, zero_stage=zero_stage)
    schedule = scheduler(engine.optimizer) if scheduler is not None else None
    share = BATCH // 2
    lo = engine.position.dp_rank * share
    for step in range(STEPS):
        inputs, targets = mlp_batch(step, BATCH)
        engine.train_batch(inputs[lo:lo + share], targets[lo:lo + share])
        if schedule is not None:
            schedule.step()
    engine.finish_param_gather()
    expected = _reference(factory, scheduler)
    error = max(float((param.detach() - expected[key]).abs().max())
                for key, param in module.named_layer_parameters())
    moved = max(float((param.detach() - _named(build_reference(mlp_layers()))[key]).abs().max())
                for key, param in module.named_layer_parameters())
    lrs = [group["lr"] for group in engine.optimizer.param_groups] \
        if engine.optimizer is not None else []
    return {"error": error, "moved": moved, "lrs": lrs}


CASES: dict[str, tuple[Callable[[Any], torch.optim.Optimizer], Any, int]] = {
    "groups/zero1": (_grouped_adamw, None, 1),
    "groups/zero0": (_grouped_adamw, None, 0),
    "step_lr/zero1": (_adam, _step_lr, 1),
    "step_lr/zero0": (_adam, _step_lr, 0),
}


class FrozenBiasLinear(nn.Linear):
    """A layer built with its bias frozen (the user unfreezes it later)."""

    def __init__(self, width: int) -> None:
        super().__init__(width, width)
        self.bias.requires_grad_(False)


def _unfreeze(zero_stage: int) -> dict[str, Any]:
    """Step 0 with layer 0's bias frozen, then `requires_grad_(True)` on it: the engine's
    buckets and optimizer were built without it, so the step is refused on every rank."""
    layers = mlp_layers()
    layers[0] = LayerSpec(FrozenBiasLinear, WIDTH)
    module = PipelineModule(layers, num_stages=2, loss_fn=F.mse_loss)
    engine = PipelineEngine(module, schedule="1f1b", num_microbatches=MICROBATCHES,
                            optimizer=_adam, data_parallel=2, zero_stage=zero_stage)
    inputs, targets = mlp_batch(0, BATCH // 2)
    engine.train_batch(inputs, targets)
    for (layer, name), param in module.named_layer_parameters():
        if (layer, name) == (0, "bias"):
            param.requires_grad_(True)
    before = {key: p.detach().clone() for key, p in module.named_layer_parameters()}
    try:
        engine.train_batch(inputs, targets)
    except PipelineConfigError as error:
        message = str(error)
    else:
        message = ""
    unchanged = all(torch.equal(p, before[key]) for key, p in module.named_layer_parameters())
    return {"message": message, "unchanged": unchanged, "first": engine.is_first_stage()}


def _without_optimizer() -> list[str]:
    """Two train_batch calls with no optimizer: what they warned on this rank."""
    module = PipelineModule(mlp_layers(), num_stages=2, loss_fn=F.mse_loss)
    engine = PipelineEngine(module, schedule="1f1b", num_microbatches=MICROBATCHES,
                            data_parallel=2)
    inputs, targets = mlp_batch(0, BATCH // 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            engine.train_batch(inputs, targets)
    return [str(warning.message) for warning in caught]


def _four_ranks(names: list[str]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name in names:
        factory, scheduler, zero_stage = CASES[name]
        results[name] = _engine_run(factory, scheduler, zero_stage)
    results["unfreeze"] = [_unfreeze(zero_stage) for zero_stage in (0, 1)]
    results["no_optimizer"] = _without_optimizer()
    return results


@pytest.fixture(scope="module")
def per_rank() -> list[dict[str, Any]]:
    return launch(_four_ranks, 4, list(CASES), timeout=60, join_timeout=240)


@pytest.mark.parametrize("name", [name for name in CASES if name.startswith("groups/")])
def test_parameter_groups_split_by_ndim_train_as_one_torch_process(
        per_rank: list[dict[str, Any]], name: str) -> None:
    for rank, results in enumerate(per_rank):
        result = results[name]
        assert result["moved"] > 1e-3, f"rank {rank}: nothing trained"
        assert result["error"] < TOLERANCE, f"rank {rank} {name}: {result['error']:.3g}"


@pytest.mark.parametrize("name", [name for name in CASES if name.startswith("step_lr/")])
def test_step_lr_on_engine_optimizer_trains_as_one_torch_process(
        per_rank: list[dict[str, Any]], name: str) -> None:
    for rank, results in enumerate(per_rank):
        result = results[name]
        assert result["lrs"] == [0.05 * 0.5**STEPS], (rank, result["lrs"])
        assert result["error"] < TOLERANCE, f"rank {rank} {name}: {result['error']:.3g}"


def test_parameter_unfrozen_after_the_engine_was_built_is_refused_on_every_rank(
        per_rank: list[dict[str, Any]]) -> None:
    """Regression: `requires_grad_(True)` after step 1 was accepted and the parameter never
    trained (torch trains it when the optimizer holds every parameter)."""
    for rank, results in enumerate(per_rank):
        for zero_stage, result in enumerate(results["unfreeze"]):
            assert result["unchanged"], (rank, zero_stage)
            if result["first"]:
                assert "requires_grad changed after the engine was built (layer 0 'bias' " \
                       "unfrozen)" in result["message"], (rank, zero_stage, result["message"])
            else:
                assert "refused the batch" in result["message"], (rank, result["message"])


def test_train_batch_without_an_optimizer_says_so_once(per_rank: list[dict[str, Any]]) -> None:
    """Regression: train_batch with no optimizer silently never updated the weights."""
    said = [[m for m in results["no_optimizer"] if "never updates the weights" in m]
            for results in per_rank]
    assert [len(messages) for messages in said] == [1, 0, 0, 0], said
