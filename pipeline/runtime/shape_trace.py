"""One microbatch through every layer and the loss on the meta device (shapes only: no memory,
no arithmetic), to find a batch that does not fit the model before any rank starts."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from pipeline.model.layers import Layer, LayerSpec, build_layer
from pipeline.model.module import PipelineModule
from pipeline.model.tied import TiedLayerSpec

__all__ = ["trace_problem"]

_SKIP_HINT = "(LaunchCheck(..., trace=False) skips this trace)"


def trace_problem(module: PipelineModule, inputs: Any, targets: Any) -> str | None:
    """Why one microbatch (`inputs`, `targets`: tensors or tuples of them) cannot run through
    `module`'s layers and its loss, or None when it runs or cannot be traced.

    Layers given as specs are built on the meta device (as `partition_method="parameters"`
    already does to count them); modules given built run with meta copies of their
    parameters and buffers (`torch.func.functional_call`: theirs are not touched). A layer
    whose code needs values (``.item()``, data-dependent control flow) cannot run on the meta
    device: the trace then stops without a verdict, and the ranks find any problem as
    before. A loss that would broadcast a target of another size (torch warns "Using a
    target size") counts as a problem: it trains on a silently wrong loss.
    """
    x = _to_meta(inputs)
    shared: dict[str, nn.Module] = {}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", message="Using a target size")
        for index in range(module.num_layers):
            layer = module.layer_definition(index)
            try:
                x = _run(layer, index, x, shared)
            except Exception as error:  # a layer may raise anything; the text says which
                if _cannot_trace(error):
                    return None
                return (f"layer {index} ({_name(layer)}) fails on a microbatch of "
                        f"{_shapes(inputs)}: {type(error).__name__}: {error}; give inputs "
                        f"of the shape the model takes, or fix layer {index} {_SKIP_HINT}")
        if targets is None or module.loss_fn is None:
            return None
        try:
            module.loss_fn(x, _to_meta(targets))
        except Exception as error:
            if _cannot_trace(error):
                return None
            return (f"loss_fn fails on the last layer's output {_shapes(x)} and targets "
                    f"{_shapes(targets)}: {type(error).__name__}: {error}; give targets the "
                    f"loss takes with that output {_SKIP_HINT}")
    return None


def _run(layer: Layer, index: int, x: Any, shared: dict[str, nn.Module]) -> Any:
    if isinstance(layer, LayerSpec | TiedLayerSpec):
        with torch.device("meta"):
            return build_layer(layer, index, base_seed=None, shared=shared)(x)
    if isinstance(layer, nn.Module):
        state = {name: tensor.to("meta") for name, tensor in
                 [*layer.named_parameters(), *layer.named_buffers()]}
        return functional_call(layer, state, (x,))
    return build_layer(layer, index, base_seed=None)(x)  # a plain callable


def _cannot_trace(error: Exception) -> bool:
    """Whether `error` is the meta device's limit, not the batch's problem."""
    return isinstance(error, NotImplementedError) or "meta" in str(error).lower()


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    return type(value)(_to_meta(item) for item in value)


def _shapes(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)}"
    return "shapes " + ", ".join(str(tuple(item.shape)) for item in value)


def _name(layer: Layer) -> str:
    if isinstance(layer, LayerSpec):
        return layer.name
    if isinstance(layer, TiedLayerSpec):
        return f"tied {layer.key!r}"
    return type(layer).__name__ if isinstance(layer, nn.Module) else \
        getattr(layer, "__name__", type(layer).__name__)
