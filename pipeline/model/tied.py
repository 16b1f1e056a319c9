"""`TiedLayerSpec`: a layer whose weights every stage that lists it shares (DeepSpeed's name)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from pipeline.model.build_context import call_with_group

__all__ = ["TiedLayerSpec"]


class TiedLayerSpec:
    """A layer built on every stage that lists it, all copies sharing the weights named in
    `tied_weight_attr` under `key` (DeepSpeed's `TiedLayerSpec`): e.g. the input embedding
    reused as the output head, with `forward_fn(module, x)` giving the head's use of it."""

    __slots__ = ("args", "cls", "forward_fn", "key", "kwargs", "tied_weight_attr")

    def __init__(self, key: str, cls: Callable[..., nn.Module], *args: Any,
                 forward_fn: Callable[[nn.Module, Any], Any] | None = None,
                 tied_weight_attr: str | Sequence[str] = ("weight",), **kwargs: Any) -> None:
        attrs = (tied_weight_attr,) if isinstance(tied_weight_attr, str) \
            else tuple(tied_weight_attr)
        problems = []
        if not isinstance(key, str) or not key:
            problems.append(f"key must be a non-empty str, got {key!r}")
        if not callable(cls):
            problems.append(f"cls must be a module class or factory, got {cls!r}")
        if forward_fn is not None and not callable(forward_fn):
            problems.append(f"forward_fn must be callable or None, got {forward_fn!r}")
        if not attrs or not all(isinstance(a, str) and a for a in attrs):
            problems.append(f"tied_weight_attr must name attributes, got {tied_weight_attr!r}")
        if problems:
            raise TypeError("TiedLayerSpec: " + "; ".join(problems))
        self.key, self.cls, self.args, self.kwargs = key, cls, args, dict(kwargs)
        self.forward_fn, self.tied_weight_attr = forward_fn, attrs

    def build(self) -> nn.Module:
        """Construct the layer (on an owning rank only); a ``group`` parameter left unfilled
        receives the rank's tensor-parallel group (`pipeline.model.build_context`)."""
        module = call_with_group(self.cls, self.args, self.kwargs)
        if not isinstance(module, nn.Module):
            raise TypeError(f"TiedLayerSpec({self.key!r}) built {type(module).__name__}, not an "
                            "nn.Module; cls must be a module class or a factory returning one")
        return module

    def tied_parameters(self, module: nn.Module) -> list[nn.Parameter]:
        """The module's parameters named by `tied_weight_attr` (dotted paths allowed)."""
        params = []
        for name in self.tied_weight_attr:
            value: Any = module
            for part in name.split("."):
                value = getattr(value, part, None)
            if not isinstance(value, nn.Parameter):
                raise AttributeError(f"tied layer {self.key!r}: {type(module).__name__} has no "
                                     f"parameter {name!r}; fix tied_weight_attr")
            params.append(value)
        return params

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TiedLayerSpec):
            return NotImplemented
        return all(getattr(self, s) == getattr(other, s) for s in self.__slots__)

    def __hash__(self) -> int:
        return hash((self.key, self.cls, self.tied_weight_attr))

    def __repr__(self) -> str:
        return (f"TiedLayerSpec({self.key!r}, {getattr(self.cls, '__name__', self.cls)}, "
                f"args={self.args!r}, kwargs={self.kwargs!r}, "
                f"tied_weight_attr={self.tied_weight_attr!r})")
