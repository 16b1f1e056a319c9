"""What the partitioner reads from user layer objects without importing torch: names and sizes."""

from __future__ import annotations

import functools
import types
from typing import Any

__all__ = ["layer_type_name", "trainable_parameter_count"]


def layer_type_name(layer: Any) -> str:
    """The class name the ``type:`` method matches: a layer spec's ``typename`` class (as in
    DeepSpeed's LayerSpec), a function's own name, else the object's class name."""
    typename = getattr(layer, "typename", None)
    if isinstance(typename, type):
        return typename.__name__
    if isinstance(layer, functools.partial):
        return layer_type_name(layer.func)
    if isinstance(layer, types.FunctionType | types.BuiltinFunctionType | types.MethodType | type):
        return str(getattr(layer, "__name__", type(layer).__name__))
    return type(layer).__name__


def trainable_parameter_count(layer: Any) -> int:
    """Elements of the parameters that require grad (DeepSpeed's ``parameters`` measure);
    0 for objects without ``.parameters()``."""
    parameters = getattr(layer, "parameters", None)
    if not callable(parameters):
        return 0
    unique = {id(parameter): parameter for parameter in parameters()}
    return sum(p.numel() for p in unique.values() if getattr(p, "requires_grad", True))
