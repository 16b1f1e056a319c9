"""Layers as users give them (modules, `LayerSpec`, callables), built with per-layer seeds."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Iterator, MutableMapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeAlias

import torch
from torch import nn

from pipeline.model.build_context import call_with_group
from pipeline.model.tied import TiedLayerSpec

__all__ = [
    "Layer",
    "LayerSpec",
    "TiedLayer",
    "build_layer",
    "check_tied_specs",
    "count_parameters",
    "normalize_layers",
    "seeded",
    "tied_seed",
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
        """Construct the layer (with whatever RNG state is current). A ``group`` parameter
        the spec leaves unfilled receives the rank's tensor-parallel group
        (`pipeline.model.build_context`)."""
        try:
            module = call_with_group(self.typename, self.args, self.kwargs)
        except (TypeError, ValueError) as error:  # the arguments do not fit the class
            # the reason first, on one line; the arguments (a whole model config can be
            # one of them) cut short after it
            kind = TypeError if isinstance(error, TypeError) else ValueError
            reason = " ".join(str(error).split()) or type(error).__name__
            raise kind(f"{reason} (building {self!r} with args {_brief(self.args)}, kwargs "
                       f"{_brief(self.kwargs)}; fix the LayerSpec's arguments)") from error
        if not isinstance(module, nn.Module):
            raise TypeError(f"LayerSpec({self.name}) built {type(module).__name__}, not an "
                            "nn.Module; pass plain callables directly instead of wrapping them")
        return module

    @property
    def name(self) -> str:
        return getattr(self.typename, "__name__", type(self.typename).__name__)

    def __repr__(self) -> str:
        return f"LayerSpec({self.name})"


def _brief(value: object, limit: int = 80) -> str:
    """`value`'s repr on one line, cut to `limit` characters."""
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


Layer: TypeAlias = "nn.Module | LayerSpec | TiedLayerSpec | Callable[..., Any]"
"""What a model's layer list may hold."""


class TiedLayer(nn.Module):
    """One occurrence of a tied layer: the module shared by every occurrence on this rank (or
    in the reference), called directly or through this occurrence's ``forward_fn(module, x)``
    (e.g. the embedding used as the output head)."""

    def __init__(self, module: nn.Module, forward_fn: Callable[[nn.Module, Any], Any] | None
                 ) -> None:
        super().__init__()
        self.module = module
        self.forward_fn = forward_fn

    def forward(self, x: Any) -> Any:
        if self.forward_fn is None:
            return self.module(x)
        return self.forward_fn(self.module, x)


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
    if isinstance(layers, nn.Module) and not isinstance(layers, nn.Sequential | nn.ModuleList):
        name = type(layers).__name__
        raise TypeError(f"layers must be a list of layers (or an nn.Sequential / nn.ModuleList), "
                        f"got one {name}; pass its layers in order, e.g. "
                        f"list(model.children()), or [model] for a one-layer pipeline")
    if isinstance(layers, str | bytes) or not isinstance(layers, Iterable):
        raise TypeError(f"layers must be a list of nn.Module, LayerSpec or callables, got "
                        f"{layers!r}")
    items: list[Layer] = list(layers.children()) if isinstance(layers, nn.Sequential) \
        else list(layers)
    classes = [f"layer {k}: the class {item.__name__} (pass an instance {item.__name__}(...) "
               f"or LayerSpec({item.__name__}, ...))" for k, item in enumerate(items)
               if isinstance(item, type) and issubclass(item, nn.Module)]
    if classes:  # a class is callable: it would build a fresh, untrained module per call
        raise TypeError("layers must be modules, not module classes; got " + "; ".join(classes))
    nested = [f"layer {k} is a {type(item).__name__} of {len(item)} modules"
              for k, item in enumerate(items) if isinstance(item, nn.ModuleList)]
    if nested:  # a ModuleList has no forward: it would fail only when the step runs
        raise TypeError("; ".join(nested) + ": a ModuleList cannot be called as one layer; "
                        "splice its modules into the list, e.g. [embed, *model.transformer.h, "
                        "head] instead of [embed, model.transformer.h, head]")
    bad = [f"layer {k}: {type(item).__name__}" for k, item in enumerate(items)
           if not (isinstance(item, nn.Module | LayerSpec | TiedLayerSpec) or callable(item))]
    if bad:
        raise TypeError("layers must be nn.Module, LayerSpec, TiedLayerSpec or callables; got "
                        + "; ".join(bad))
    if not items:
        raise ValueError("PipelineModule needs at least one layer, got an empty list")
    return items


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block with the CPU generator seeded to `seed`; restore the state afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def check_tied_specs(layers: Sequence[Layer]) -> dict[int, str]:
    """Layer index -> tied key of every `TiedLayerSpec`; raises `ValueError` listing every key
    whose occurrences disagree on what to build (only `forward_fn` may differ)."""
    keys: dict[int, str] = {}
    first: dict[str, TiedLayerSpec] = {}
    problems = []
    for index, layer in enumerate(layers):
        if not isinstance(layer, TiedLayerSpec):
            continue
        keys[index] = layer.key
        seen = first.setdefault(layer.key, layer)
        built = (layer.cls, layer.args, layer.kwargs, layer.tied_weight_attr)
        if built == (seen.cls, seen.args, seen.kwargs, seen.tied_weight_attr):
            continue
        if layer.cls is not seen.cls:
            problems.append(
                f"layer {index} builds with {_describe_factory(layer.cls)} but an earlier "
                f"occurrence of key {layer.key!r} builds with {_describe_factory(seen.cls)}: "
                "two factory objects, even equal-looking ones, may build different modules; "
                "define the factory once and pass that same object to every occurrence")
        else:
            problems.append(f"layer {index} builds {layer!r} but an earlier occurrence of key "
                            f"{layer.key!r} builds {seen!r}; give every occurrence the same "
                            "arguments (only forward_fn may differ)")
    if problems:
        raise ValueError("tied layers of one key must build the same module (only forward_fn "
                         "may differ): " + "; ".join(problems))
    return keys


def _describe_factory(factory: Any) -> str:
    """A factory told apart from an equal-looking one: qualified name, definition site, id."""
    name = getattr(factory, "__qualname__", type(factory).__qualname__)
    code = getattr(factory, "__code__", None)
    where = f" at {code.co_filename}:{code.co_firstlineno}" if code is not None else ""
    return f"{name}{where} (object id {id(factory):#x})"


def tied_seed(base_seed: int, key: str) -> int:
    """The seed of a tied layer: from its key, not its position, so every occurrence (on any
    rank, and in the reference) starts from the same weights."""
    return base_seed + zlib.crc32(key.encode())


def build_layer(layer: Layer, index: int, *, base_seed: int | None,
                device: torch.device | None = None,
                shared: MutableMapping[str, nn.Module] | None = None) -> nn.Module:
    """Layer `index` as a module on `device`.

    A `LayerSpec` is built with the CPU generator seeded to ``base_seed + index`` (unless
    `base_seed` is None), so the same weights appear however the model is partitioned. A
    `TiedLayerSpec` is seeded by `tied_seed` and built once per key in `shared` (the modules
    already built on this rank): every later occurrence wraps the same module.
    """
    if isinstance(layer, TiedLayerSpec):
        module = shared.get(layer.key) if shared is not None else None
        if module is None:
            if base_seed is None:
                module = layer.build()
            else:
                with seeded(tied_seed(base_seed, layer.key)):
                    module = layer.build()
            if device is not None:
                module = module.to(device)
            if shared is not None:
                shared[layer.key] = module
        return TiedLayer(module, layer.forward_fn)
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


def count_parameters(layer: Layer) -> int:
    """Trainable parameter count; a `LayerSpec` is built on the meta device (no memory)."""
    if isinstance(layer, LayerSpec | TiedLayerSpec):
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
