"""A plain single-process run of the same layers: the ground truth the pipeline must equal."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeline.model.layers import Layer, build_layer, normalize_layers
from pipeline.model.module import LossFn
from pipeline.parallel.optimizer import OptimizerFactory

__all__ = ["ReferenceResult", "build_reference", "reference_forward",
           "reference_step"]

"""``lambda params: torch.optim.SGD(params, lr=0.1)``."""

ParamKey = tuple[int, str]
"""(global layer index, parameter name inside the layer): the same key as
`PipelineModule.named_layer_parameters`."""


@dataclass(frozen=True)
class ReferenceResult:
    """What one full-batch training step produced."""

    loss: float
    """Mean loss over the full batch."""
    grads: dict[ParamKey, torch.Tensor]
    """Every parameter's gradient (before the optimizer step)."""
    params: dict[ParamKey, torch.Tensor]
    """Every parameter after the optimizer step (before it when no optimizer was given)."""
    grad_norm: float | None = None
    """Global gradient norm before clipping (only when `max_grad_norm` was given)."""


def build_reference(layers: Sequence[Layer] | nn.Sequential, *,
                    base_seed: int | None = 1234) -> nn.ModuleList:
    """Every layer built as `PipelineModule` builds it (same per-layer seeds, full-size
    tensor-parallel layers); prebuilt modules are deep-copied so the reference never shares
    parameters with a pipeline. Occurrences of one tied key share one module, so its
    gradient is the sum over its uses."""
    items = normalize_layers(layers)
    # one deepcopy of all prebuilt modules together, so a module listed twice (or two
    # modules sharing a parameter) stay shared in the copy, as in the user's model
    copies = copy.deepcopy([layer if isinstance(layer, nn.Module) else None for layer in items])
    shared: dict[str, nn.Module] = {}
    return nn.ModuleList(
        build_layer(layer if copied is None else copied, k, base_seed=base_seed, shared=shared)
        for k, (layer, copied) in enumerate(zip(items, copies)))


def reference_forward(model: nn.ModuleList, inputs: Any) -> Any:
    """Run the layers in order; the value between layers is passed as is."""
    x = inputs
    for layer in model:
        x = layer(x)
    return x


def _named(model: nn.ModuleList) -> Iterable[tuple[ParamKey, nn.Parameter]]:
    for index, layer in enumerate(model):
        for name, param in layer.named_parameters():
            yield (index, name), param


def reference_step(layers: Sequence[Layer] | nn.Sequential | nn.ModuleList, inputs: Any,
                   targets: Any, *, loss_fn: LossFn,
                   optimizer: OptimizerFactory | torch.optim.Optimizer | None = None,
                   base_seed: int | None = 1234,
                   max_grad_norm: float | None = None) -> ReferenceResult:
    """Forward the full batch, mean loss, backward, (clip,) one optimizer step.

    `layers` is either the user's layer list (built here with the per-layer seeds) or a
    model from `build_reference` (kept across steps by the caller). `grads` are before
    clipping by `max_grad_norm`. A factory builds a fresh optimizer each call; for a stateful
    one (Adam) over several steps pass an optimizer built once over the model's parameters.
    """
    model = layers if isinstance(layers, nn.ModuleList) else build_reference(
        layers, base_seed=base_seed)
    model.zero_grad(set_to_none=True)
    loss = loss_fn(reference_forward(model, inputs), targets)
    loss.backward()
    grads = {key: (param.grad.detach().clone() if param.grad is not None
                   else torch.zeros_like(param)) for key, param in _named(model)}
    trainable = [p for p in model.parameters() if p.requires_grad]
    grad_norm = None
    if max_grad_norm is not None:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable, max_grad_norm))
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer.step()
    elif optimizer is not None:
        optimizer(trainable).step()
    params = {key: param.detach().clone() for key, param in _named(model)}
    return ReferenceResult(float(loss.detach()), grads, params, grad_norm)
