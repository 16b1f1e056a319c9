"""Build-time checks that no parameter escapes training: hidden in callables, or shared by layers.

A pipeline builds each stage on its own rank, so two facts a single process gets for free
are lost without a word: a weight a layer uses without registering it (closed over by a
callable, held as a class attribute, ...: `pipeline.model.hidden_weights`) is never handed to
an optimizer, and a module (or a parameter) listed at two positions — directly, or returned
by a `LayerSpec` factory such as ``LayerSpec(lambda: shared)`` — becomes two independent
copies. Both are found here, from the layer list, before any rank builds its stages.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from pipeline.model.hidden_weights import (
    Hidden,
    WalkTooLarge,
    find_hidden_in_class,
    find_hidden_in_module,
    find_hidden_in_values,
    find_hidden_modules,
)
from pipeline.model.layers import LayerSpec
from pipeline.model.tied import TiedLayerSpec

__all__ = ["SharedGroup", "find_hidden_modules", "find_shared_groups", "hidden_module_problems",
           "reaches_existing_weights", "shared_layer_problems", "starts_in_place",
           "tie_shared_groups"]

def _describe(obj: Hidden) -> str:
    if isinstance(obj, nn.Parameter):
        return f"a Parameter of shape {tuple(obj.shape)}"
    if isinstance(obj, torch.Tensor):
        return f"a tensor with requires_grad=True of shape {tuple(obj.shape)}"
    count = sum(p.numel() for p in obj.parameters() if p.requires_grad)
    return f"{type(obj).__name__} with {count} trainable parameters"


_CALLABLE_FIX = ("a callable's parameters are never given to the optimizer (and get no "
                 "gradient under zero-bubble schedules); make that module the layer itself, "
                 "e.g. replace `lambda x: norm(x[0])` by a nn.Module whose __init__ holds "
                 "`norm` (or LayerSpec(ThatModule, ...))")
_MODULE_FIX = ("weights a module holds without registering them (a class attribute, a plain "
               "list or dict, a tensor that is not an nn.Parameter) are never given to the "
               "optimizer; make them attributes of the instance (self.x = module), "
               "nn.ModuleList / nn.ModuleDict, or nn.Parameter")
_FACTORY_FIX = ("its factory returns (or builds from) a module that already exists; list that "
                "module itself, or build a new one in the factory")


def _name(layer: Any) -> str:
    if isinstance(layer, LayerSpec):
        return repr(layer)
    if isinstance(layer, types.FunctionType | types.MethodType | types.BuiltinFunctionType
                  | type):
        return str(layer.__qualname__)
    # an object's own __getattr__ may raise anything (a config's KeyError) for __qualname__
    return type(layer).__qualname__


def _found_in(layer: Any) -> tuple[list[tuple[str, Hidden]], str]:
    """What `layer` hides, and the fix."""
    if isinstance(layer, nn.Module):
        return find_hidden_in_module(layer), _MODULE_FIX
    if isinstance(layer, LayerSpec | TiedLayerSpec):
        factory = layer.typename if isinstance(layer, LayerSpec) else layer.cls
        if isinstance(factory, type):
            return find_hidden_in_class(factory), _MODULE_FIX
        return [], _FACTORY_FIX  # a factory reaching modules: `reaches_existing_weights`
    return find_hidden_modules(layer), _CALLABLE_FIX


def hidden_module_problems(layers: Sequence[Any]) -> list[str]:
    """One line per layer holding weights that would never be trained."""
    problems = []
    for index, layer in enumerate(layers):
        if not callable(layer) and not isinstance(layer, LayerSpec | TiedLayerSpec):
            continue
        try:
            found, fix = _found_in(layer)
        except WalkTooLarge as error:
            problems.append(f"layer {index} ({_name(layer)}) {error}: it cannot be checked for "
                            "hidden weights; hold fewer objects in it, or make it a module")
            continue
        for path, obj in found:
            problems.append(f"layer {index} ({_name(layer)}) reaches {_describe(obj)} through "
                            f"its {path}: {fix}")
    return problems


def reaches_existing_weights(layer: Any) -> bool:
    """Whether a `LayerSpec`'s factory or arguments reach a module (or trainable tensor) that
    already exists: built at two positions it would be one module split in two copies."""
    if not isinstance(layer, LayerSpec):
        return False
    if not isinstance(layer.typename, type) and find_hidden_modules(layer.typename):
        return True
    arguments = [(f"argument {k}", arg) for k, arg in enumerate(layer.args)] + [
        (f"keyword {name!r}", arg) for name, arg in layer.kwargs.items()]
    return bool(find_hidden_in_values(arguments))


class SharedGroup:
    """Layer positions whose modules are one object or share a parameter (union of both)."""

    def __init__(self, positions: list[int], modules: list[nn.Module],
                 links: list[str]) -> None:
        self.positions = positions
        """Layer indices in the group, ascending."""
        self.modules = modules
        """The distinct modules of the group, in position order."""
        self.links = links
        """What ties them, as text: 'layer 0 and layer 5 are the same Linear', ..."""


def find_shared_groups(layers: Sequence[Any]) -> list[SharedGroup]:
    """Groups of prebuilt module layers that are the same object or share a parameter."""
    parent: dict[int, int] = {}

    def root(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    owner_of_module: dict[int, int] = {}
    owner_of_param: dict[int, tuple[int, str]] = {}
    links: list[tuple[int, str]] = []
    for index, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            continue
        parent[index] = index
        earlier = owner_of_module.setdefault(id(layer), index)
        if earlier != index:
            parent[root(index)] = root(earlier)
            links.append((earlier, f"layer {earlier} and layer {index} are the same "
                                   f"{type(layer).__name__} object"))
            continue
        for name, param in layer.named_parameters(remove_duplicate=False):
            first_index, first_name = owner_of_param.setdefault(id(param), (index, name))
            if first_index != index:
                parent[root(index)] = root(first_index)
                links.append((first_index, f"layer {first_index}'s {first_name!r} is layer "
                                           f"{index}'s {name!r}"))
    groups: dict[int, list[int]] = {}
    for index in parent:
        groups.setdefault(root(index), []).append(index)
    result = []
    for members in groups.values():
        if len(members) < 2:
            continue
        members.sort()
        modules = list({id(layers[k]): layers[k] for k in members}.values())
        text = [t for first, t in links if root(first) == root(members[0])]
        result.append(SharedGroup(members, modules, text))
    return sorted(result, key=lambda g: g.positions[0])


def shared_layer_problems(groups: Sequence[SharedGroup]) -> list[str]:
    """One line per group of layers whose sharing a pipeline would silently break."""
    # wherever the partition puts them (one stage or several): positions own their weights
    return [f"layers {g.positions} share weights ({'; '.join(g.links)}): a pipeline owns each "
            "layer position's weights (per stage, on its rank), so one module at several "
            "positions is a weight tie it must keep, which it does for tied layers only; list "
            "them as TiedLayerSpec(key, factory, forward_fn=...) occurrences, or pass "
            "PipelineModule(..., tie_shared=True) to tie them as they are"
            for g in groups]


class _SharedModules(nn.Module):
    """The distinct modules of one `SharedGroup`, held together as one tied layer."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(modules)


class _Existing:
    """A factory returning a module that already exists (the user built it)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.__name__ = type(module).__name__

    def __call__(self) -> nn.Module:
        return self.module


def _call_part(part: int, shared: nn.Module, x: Any) -> Any:
    parts: Any = shared.parts
    return parts[part](x)


def tie_shared_groups(layers: Sequence[Any], groups: Sequence[SharedGroup]) -> list[Any]:
    """`layers` with every position of each group replaced by a `TiedLayerSpec` occurrence
    of one container holding the group's modules: each stage calls its own module of the
    container, and the tied-weight sync sums every shared parameter's gradient over stages."""
    result = list(layers)
    for group in groups:
        container = _SharedModules(group.modules)
        factory = _Existing(container)  # one object: every occurrence builds the same
        names = [name for name, _ in container.named_parameters()]
        part_of = {id(module): k for k, module in enumerate(group.modules)}
        for index in group.positions:
            part = part_of[id(layers[index])]
            result[index] = TiedLayerSpec(
                f"shared-layers-{group.positions[0]}", factory,
                forward_fn=functools.partial(_call_part, part), tied_weight_attr=names)
    return result


def starts_in_place(module: nn.Module) -> bool:
    """Whether the module's first operation may write into its input (``ReLU(inplace=True)``,
    or a `Sequential` starting with one): a received stage input must then be cloned."""
    while isinstance(module, nn.Sequential) and len(module) > 0:
        module = module[0]
    return bool(getattr(module, "inplace", False))
