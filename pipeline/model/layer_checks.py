"""Build-time checks that no parameter escapes training: hidden in callables, or shared by layers.

A pipeline builds each stage on its own rank, so two facts a single process gets for free
are lost without a word: a module a plain callable closes over is never handed to an
optimizer, and a module (or a parameter) listed at two positions becomes two independent
copies. Both are found here, from the layer list alone, before any rank builds anything.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch import nn

from pipeline.model.layers import LayerSpec
from pipeline.model.tied import TiedLayerSpec

__all__ = ["SharedGroup", "find_hidden_modules", "find_shared_groups", "hidden_module_problems",
           "shared_layer_problems", "starts_in_place", "tie_shared_groups"]

_MAX_DEPTH = 3
"""How far to follow callables into callables (a partial of a bound method of an object...)."""


def _code_names(code: types.CodeType) -> Iterator[str]:
    """Global names a function's code (and the code of functions defined inside it) reads."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_names(const)


def _references(fn: Any) -> Iterator[tuple[str, Any]]:
    """(how it is reached, object) for everything a callable can use besides its arguments."""
    if isinstance(fn, functools.partial):
        yield "the partial's function", fn.func
        for k, arg in enumerate(fn.args):
            yield f"partial argument {k}", arg
        for name, arg in fn.keywords.items():
            yield f"partial keyword {name!r}", arg
        return
    if isinstance(fn, types.MethodType):
        yield "the bound method's self", fn.__self__
        fn = fn.__func__
    if isinstance(fn, types.FunctionType):
        names = fn.__code__.co_freevars
        for name, cell in zip(names, fn.__closure__ or ()):
            try:
                yield f"closure variable {name!r}", cell.cell_contents
            except ValueError:  # an empty cell: the variable was never assigned
                continue
        for k, default in enumerate(fn.__defaults__ or ()):
            yield f"default argument {k}", default
        for name, default in (fn.__kwdefaults__ or {}).items():
            yield f"keyword default {name!r}", default
        for name in dict.fromkeys(_code_names(fn.__code__)):
            if name in fn.__globals__:
                yield f"global {name!r}", fn.__globals__[name]
        return
    if not isinstance(fn, type | types.BuiltinFunctionType | types.ModuleType) and hasattr(
            fn, "__dict__"):  # a callable object: its attributes
        for name, value in vars(fn).items():
            yield f"attribute {name!r}", value


def find_hidden_modules(fn: Callable[..., Any]) -> list[tuple[str, nn.Module | nn.Parameter]]:
    """Modules and parameters with trainable weights that a plain (non-module) callable can
    reach through closures, defaults, globals it names, bound ``self``, partials and the
    attributes of callable objects: (path, object) each, e.g. ``("closure variable 'norm'",
    LayerNorm(...))``."""
    found: list[tuple[str, nn.Module | nn.Parameter]] = []
    seen: set[int] = set()

    def visit(obj: Any, path: str, depth: int) -> None:
        if id(obj) in seen or depth > _MAX_DEPTH:
            return
        seen.add(id(obj))
        if isinstance(obj, nn.Parameter):
            if obj.requires_grad:
                found.append((path, obj))
        elif isinstance(obj, nn.Module):
            if any(p.requires_grad for p in obj.parameters()):
                found.append((path, obj))
        elif isinstance(obj, list | tuple | set | frozenset):
            for k, item in enumerate(obj):
                visit(item, f"{path}[{k}]", depth + 1)
        elif isinstance(obj, dict):
            for key, item in obj.items():
                visit(item, f"{path}[{key!r}]", depth + 1)
        elif callable(obj) and not isinstance(obj, type):
            for how, ref in _references(obj):
                visit(ref, f"{path} -> {how}" if path else how, depth + 1)
        elif not isinstance(obj, type | types.ModuleType) and hasattr(obj, "__dict__"):
            for name, value in vars(obj).items():  # e.g. `self` of the method that built it
                visit(value, f"{path}.{name}", depth + 1)

    for how, ref in _references(fn):
        visit(ref, how, 1)
    return found


def _describe(obj: nn.Module | nn.Parameter) -> str:
    if isinstance(obj, nn.Parameter):
        return f"a Parameter of shape {tuple(obj.shape)}"
    count = sum(p.numel() for p in obj.parameters() if p.requires_grad)
    return f"{type(obj).__name__} with {count} trainable parameters"


def hidden_module_problems(layers: Sequence[Any]) -> list[str]:
    """One line per plain callable whose weights would never be trained."""
    problems = []
    for index, layer in enumerate(layers):
        if isinstance(layer, nn.Module | LayerSpec | TiedLayerSpec) or not callable(layer):
            continue
        for path, obj in find_hidden_modules(layer):
            name = getattr(layer, "__qualname__", type(layer).__name__)
            problems.append(
                f"layer {index} ({name}) reaches {_describe(obj)} through its {path}: a "
                "callable's parameters are never given to the optimizer (and get no gradient "
                "under zero-bubble schedules); make that module the layer itself, e.g. "
                "replace `lambda x: norm(x[0])` by a nn.Module whose __init__ holds `norm` "
                "(or LayerSpec(ThatModule, ...))")
    return problems


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
    return [f"layers {g.positions} share weights ({'; '.join(g.links)}): each pipeline stage "
            "would train its own copy and the tie would be lost; list them as "
            "TiedLayerSpec(key, factory, forward_fn=...) occurrences, or pass "
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
