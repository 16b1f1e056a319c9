"""Layers as users give them (modules, `LayerSpec`, callables), built with per-layer seeds."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeAlias

import torch
from torch import nn

__all__ = [
    "Layer",
    "LayerSpec",
    "build_layer",
    "count_parameters",
    "layer_type_name",
    "normalize_layers",
    "seeded",
]


class LayerSpec:
    """A layer built later, only on the rank that owns it: ``LayerSpec(nn.Linear, 512, 512)``.

    As in DeepSpeed: the class (or any factory) and its arguments are kept, so no rank ever
    allocates the layers it does not run.
    """

    def __init__(self, typename: Callable[..., nn.Module], *args: Any, **kwargs: Any) -> None:
        if not callable(typename):
            raise TypeError(f"LayerSpec needs a module class or factory, got {typename!r}")
        self.typename = typename
        self.args = args
        self.kwargs = kwargs

    def build(self) -> nn.Module:
        """Construct the layer (with whatever RNG state is current)."""
        try:
            module = self.typename(*self.args, **self.kwargs)
        except (TypeError, ValueError) as error:  # the arguments do not fit the class
            kind = TypeError if isinstance(error, TypeError) else ValueError
            raise kind(f"{self!r} with args {self.args!r} and kwargs {self.kwargs!r} cannot be "
                       f"built: {error}; fix the LayerSpec's arguments") from error
        if not isinstance(module, nn.Module):
            raise TypeError(f"LayerSpec({self.name}) built {type(module).__name__}, not an "
                            "nn.Module; pass plain callables directly instead of wrapping them")
        return module

    @property
    def name(self) -> str:
        return getattr(self.typename, "__name__", type(self.typename).__name__)

    def __repr__(self) -> str:
        return f"LayerSpec({self.name})"


Layer: TypeAlias = "nn.Module | LayerSpec | Callable[..., Any]"
"""What a model's layer list may hold."""


class _Call(nn.Module):
    """A parameter-free callable as a module, so stages are plain `nn.Module` lists."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: Any) -> Any:
        return self.fn(x)

    def extra_repr(self) -> str:
        return getattr(self.fn, "__name__", repr(self.fn))


def normalize_layers(layers: Sequence[Layer] | nn.Sequential) -> list[Layer]:
    """The layers as a list, each checked to be a module, a `LayerSpec` or a callable."""
    if isinstance(layers, nn.Module) and not isinstance(layers, nn.Sequential):
        raise TypeError(f"layers must be a list of layers or an nn.Sequential, got one "
                        f"{type(layers).__name__}; wrap it: [{type(layers).__name__}(...)]")
    if isinstance(layers, str | bytes) or not isinstance(layers, Iterable):
        raise TypeError(f"layers must be a list of nn.Module, LayerSpec or callables, got "
                        f"{layers!r}")
    items: list[Layer] = list(layers.children()) if isinstance(layers, nn.Sequential) \
        else list(layers)
    bad = [f"layer {k}: {type(item).__name__}" for k, item in enumerate(items)
           if not (isinstance(item, nn.Module | LayerSpec) or callable(item))]
    if bad:
        raise TypeError("layers must be nn.Module, LayerSpec or callables; got " + "; ".join(bad))
    if not items:
        raise ValueError("PipelineModule needs at least one layer, got an empty list")
    return items


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block with the CPU generator seeded to `seed`; restore the state afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def build_layer(layer: Layer, index: int, *, base_seed: int | None,
                device: torch.device | None = None) -> nn.Module:
    """Layer `index` as a module on `device`.

    A `LayerSpec` is built with the CPU generator seeded to ``base_seed + index`` (unless
    `base_seed` is None), so the same weights appear however the model is partitioned.
    """
    if isinstance(layer, LayerSpec):
        if base_seed is None:
            module = layer.build()
        else:
            with seeded(base_seed + index):
                module = layer.build()
    elif isinstance(layer, nn.Module):
        module = layer
    else:
        module = _Call(layer)
    return module.to(device) if device is not None else module


def layer_type_name(layer: Layer) -> str:
    """The class name that ``type:<regex>`` partitioning matches against."""
    if isinstance(layer, LayerSpec):
        return layer.name
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", type(layer).__name__)


def count_parameters(layer: Layer) -> int:
    """Trainable parameter count; a `LayerSpec` is built on the meta device (no memory)."""
    if isinstance(layer, LayerSpec):
        try:
            with torch.device("meta"):
                module = layer.build()
        except (RuntimeError, NotImplementedError, TypeError):
            with seeded(0):  # the layer's factory does not support meta: build it for real
                module = layer.build()
    elif isinstance(layer, nn.Module):
        module = layer
    else:
        return 0
    return sum(p.numel() for p in module.parameters() if p.requires_grad)
