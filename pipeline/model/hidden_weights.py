"""Trainable weights a layer can reach that no optimizer would be given: the reference walk.

A pipeline hands each stage's ``parameters()`` to its optimizer, so a weight a layer uses
without registering it is never trained (and, built on another rank, is a separate copy).
Such weights hide in a plain callable's closures, defaults, globals, bound ``self``,
partials, the attributes or ``__slots__`` of a callable object and of its class; and in a
module layer's class attributes or plain (unregistered) attributes. Wherever the walk meets a
Python module (a global, a closure variable after ``import mylib`` in a builder, a local
``types.ModuleType``, an instance attribute, ``importlib.import_module("mylib")`` of a loaded
module in the code) it follows the module's attributes that the code it walked names.
Containers are followed to any depth; only hops from one function into the functions it
names are bounded (`MAX_CALL_HOPS`), since those lead into libraries. A walk that meets
more than `MAX_OBJECTS` objects stops with `WalkTooLarge` rather than passing a layer it has
not checked.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["MAX_CALL_HOPS", "MAX_OBJECTS", "Hidden", "WalkTooLarge", "find_hidden_in_class",
           "find_hidden_in_module", "find_hidden_in_values", "find_hidden_modules"]

MAX_CALL_HOPS = 3
"""How far to follow functions into the functions they name (a partial of a bound method of
an object...): beyond that the walk is in library code."""
MAX_OBJECTS = 100_000
"""Objects one walk may visit (containers and objects; numbers and strings are free)."""

Hidden = nn.Module | torch.Tensor
"""A module with trainable parameters, or a tensor with ``requires_grad`` (a Parameter or a
plain leaf tensor)."""

_ATOMS = (str, bytes, int, float, complex, bool, type(None), range, slice, torch.dtype,
          torch.device)
_MODULE_INTERNALS = frozenset(vars(nn.Module()))
"""What every module keeps in its ``__dict__`` (registries, hooks): not user attributes."""


class WalkTooLarge(ValueError):
    """A layer reaches more objects than `MAX_OBJECTS`: it cannot be checked."""

    def __init__(self, path: str) -> None:
        super().__init__(f"reaches more than {MAX_OBJECTS} objects (e.g. through its {path})")
        self.path = path


def _code_names(code: types.CodeType) -> Iterator[str]:
    """Global and attribute names a function's code (and the code defined inside it) reads."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_names(const)


def _code_strings(code: types.CodeType) -> Iterator[str]:
    """String constants of a function's code (and the code defined inside it)."""
    for const in code.co_consts:
        if isinstance(const, str):
            yield const
        elif isinstance(const, types.CodeType):
            yield from _code_strings(const)


def _call_function(cls: type) -> Any:
    """The `__call__` a class's instances run (None for a builtin or inherited from object)."""
    return next((vars(klass)["__call__"] for klass in cls.__mro__
                 if "__call__" in vars(klass)), None)


def _read_names(fn: Any) -> frozenset[str]:
    """The names a callable's code reads (a function, a bound method, or an object's
    `__call__`): which attributes of the modules it reaches it can use."""
    if isinstance(fn, types.MethodType):
        fn = fn.__func__
    if not isinstance(fn, types.FunctionType):
        fn = _call_function(type(fn))
    return frozenset(_code_names(fn.__code__)) if isinstance(fn, types.FunctionType) \
        else frozenset()


def _module_attributes(module: types.ModuleType, names: frozenset[str], path: str,
                       depth: int = 0) -> Iterator[tuple[str, Any]]:
    """The attributes of an imported module that a function's code names (``mod.norm``),
    through submodules (``pkg.sub.norm``)."""
    for name in sorted(names):
        value = getattr(module, name, None) if name in vars(module) else None
        if value is None:
            continue
        if isinstance(value, types.ModuleType):
            if depth < 2:
                yield from _module_attributes(value, names, f"{path}.{name}", depth + 1)
        else:
            yield f"{path}.{name}", value


def _slots(obj: Any) -> Iterator[tuple[str, Any]]:
    for cls in type(obj).__mro__:
        slots = vars(cls).get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            try:  # an unset slot, read through the object's own __getattr__: anything
                value = getattr(obj, name)
            except Exception:
                continue
            yield f"slot {name!r}", value


def _class_attributes(cls: type) -> Iterator[tuple[str, Any]]:
    """Non-dunder attributes of `cls` and its bases that hold data (methods, properties and
    other descriptors are code, not weights)."""
    for klass in cls.__mro__:
        if klass in (object, nn.Module):
            continue
        for name, value in vars(klass).items():
            if name.startswith("__") or isinstance(value, types.FunctionType | classmethod |
                                                   staticmethod | property):
                continue
            yield f"class attribute {klass.__name__}.{name}", value


def _references(fn: Any) -> Iterator[tuple[str, Any]]:
    """(how it is reached, object) for everything a callable can use besides its arguments."""
    if isinstance(fn, functools.partial):
        yield "partial's function", fn.func
        for k, arg in enumerate(fn.args):
            yield f"partial argument {k}", arg
        for name, arg in fn.keywords.items():
            yield f"partial keyword {name!r}", arg
        return
    if isinstance(fn, types.MethodType):
        yield "bound method's self", fn.__self__
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
        read = frozenset(_code_names(fn.__code__))
        for name in sorted(read):
            if name not in fn.__globals__:
                continue
            value = fn.__globals__[name]
            if isinstance(value, types.ModuleType):  # only what the code reads of it
                yield from _module_attributes(value, read, f"global {name!r}")
            else:
                yield f"global {name!r}", value
        if read & {"import_module", "__import__"}:  # importlib.import_module("mylib")
            for name in sorted(set(_code_strings(fn.__code__))):
                if isinstance(sys.modules.get(name), types.ModuleType):
                    yield f"imported module {name!r}", sys.modules[name]
        return
    if isinstance(fn, type | types.BuiltinFunctionType | types.ModuleType):
        return
    # a callable object: its attributes, slots, class attributes and its __call__'s code
    yield from ((f"attribute {name!r}", value) for name, value in vars(fn).items()) \
        if hasattr(fn, "__dict__") else iter(())
    yield from _slots(fn)
    yield from _class_attributes(type(fn))
    call = _call_function(type(fn))
    if isinstance(call, types.FunctionType):
        yield "__call__", call


class _Walk:
    """One walk from a layer: what it found, what it saw, how many objects it visited."""

    def __init__(self, registered: frozenset[int] = frozenset()) -> None:
        self.found: list[tuple[str, Hidden]] = []
        self.seen: set[int] = set(registered)
        self.visited = 0
        self.names: set[str] = set()
        """Names the code walked so far reads: the attributes of a module it may use."""
        self.modules: list[tuple[types.ModuleType, str, int]] = []
        """Python modules met (with path and hops), followed once every name is known."""

    def finish(self) -> list[tuple[str, Hidden]]:
        """Follow the Python modules met into the attributes the walked code names; what
        was found."""
        while self.modules:
            module, path, hops = self.modules.pop()
            for how, value in _module_attributes(module, frozenset(self.names), path):
                self.visit(value, how, hops)
        return self.found

    def visit(self, obj: Any, path: str, hops: int) -> None:
        if isinstance(obj, _ATOMS) or id(obj) in self.seen:
            return
        self.seen.add(id(obj))
        self.visited += 1
        if self.visited > MAX_OBJECTS:
            raise WalkTooLarge(path)
        if isinstance(obj, torch.Tensor):
            if obj.requires_grad and obj.is_leaf:
                self.found.append((path, obj))
        elif isinstance(obj, nn.Module):
            if any(p.requires_grad and id(p) not in self.seen for p in obj.parameters()):
                self.found.append((path, obj))
        elif isinstance(obj, list | tuple | set | frozenset):
            for k, item in enumerate(obj):
                self.visit(item, f"{path}[{k}]", hops)
        elif isinstance(obj, dict):
            for key, item in obj.items():
                self.visit(item, f"{path}[{key!r}]", hops)
        elif isinstance(obj, types.ModuleType):
            self.modules.append((obj, path, hops))  # through the names code reads: at finish
        elif isinstance(obj, type):
            return  # a class is code
        elif callable(obj):
            self.names |= _read_names(obj)
            if hops < MAX_CALL_HOPS:
                for how, ref in _references(obj):
                    self.visit(ref, f"{path} -> {how}", hops + 1)
        else:  # a plain object (e.g. `self` of the method that built the layer)
            for name, value in vars(obj).items() if hasattr(obj, "__dict__") else ():
                self.visit(value, f"{path}.{name}", hops)
            for how, value in _slots(obj):
                self.visit(value, f"{path} {how}", hops)


def find_hidden_modules(fn: Any) -> list[tuple[str, Hidden]]:
    """Trainable modules and tensors a plain (non-module) callable can reach: (path, object)
    each, e.g. ``("closure variable 'norm'", LayerNorm(...))``. Raises `WalkTooLarge`."""
    walk = _Walk()
    walk.seen.add(id(fn))
    walk.names |= _read_names(fn)
    for how, ref in _references(fn):
        walk.visit(ref, how, 1)
    return walk.finish()


def find_hidden_in_values(named: Iterable[tuple[str, Any]]) -> list[tuple[str, Hidden]]:
    """Trainable modules and tensors reachable from (how, value) pairs (e.g. a factory's
    arguments)."""
    walk = _Walk()
    for how, value in named:
        walk.visit(value, how, 1)
    return walk.finish()


def find_hidden_in_class(cls: type) -> list[tuple[str, Hidden]]:
    """Trainable modules and tensors held as class attributes of `cls` (a layer's class):
    shared by every instance and registered by none."""
    walk = _Walk()
    walk.names |= _read_names(getattr(cls, "forward", None))
    for how, value in _class_attributes(cls):
        walk.visit(value, how, 1)
    return walk.finish()


def find_hidden_in_module(layer: nn.Module) -> list[tuple[str, Hidden]]:
    """Trainable modules and tensors a module layer (or any module inside it) holds without
    registering them: class attributes, plain attributes (in containers too), tensors with
    ``requires_grad`` that are not Parameters. Its own parameters and modules are skipped."""
    registered = frozenset(id(p) for p in layer.parameters()) | frozenset(
        id(m) for m in layer.modules())
    walk = _Walk(registered)
    classes: set[type] = set()
    for name, module in layer.named_modules():
        prefix = f"{name}." if name else ""
        if type(module) not in classes:
            classes.add(type(module))
            walk.names |= _read_names(getattr(type(module), "forward", None))
            for how, value in _class_attributes(type(module)):
                walk.visit(value, how, 1)
        for attribute, value in vars(module).items():
            if attribute not in _MODULE_INTERNALS:
                walk.visit(value, f"attribute {prefix}{attribute}", 1)
    return walk.finish()
