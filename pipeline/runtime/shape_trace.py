"""One microbatch through every layer and the loss on the meta device (shapes only: no memory,
no arithmetic), to find a batch that does not fit the model before any rank starts."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.overrides import TorchFunctionMode

from pipeline.model.layers import Layer, LayerSpec, build_layer
from pipeline.model.module import PipelineModule
from pipeline.model.tied import TiedLayerSpec

__all__ = ["trace_problem"]

_SKIP_HINT = "(LaunchCheck(..., trace=False) skips this trace)"


_GEMMS = frozenset({F.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm,
                    torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
                    torch.Tensor.mm, torch.Tensor.bmm, F.conv1d, F.conv2d, F.conv3d,
                    F.bilinear})


_AUTOCAST_CASTS = frozenset({torch.float32, torch.float16, torch.bfloat16})
"""What autocast casts to its dtype before a GEMM (not float64, integers, complex)."""


class _SameDtypeGemms(TorchFunctionMode):
    """Refuses a GEMM of mixed dtypes as the real kernels do ("mat1 and mat2 must have the
    same dtype"), which the meta device's do not check: int64 or complex inputs to a Linear
    would pass the trace and fail on every rank. Under mixed precision (`autocast`) floating
    dtypes but float64 may differ (autocast casts them); others may not."""

    def __init__(self, autocast: bool) -> None:
        super().__init__()
        self.autocast = autocast

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _GEMMS:
            tensors = [value for value in (*args, *kwargs.values())
                       if isinstance(value, torch.Tensor)]
            dtypes = sorted({str(tensor.dtype) for tensor in tensors})
            if len(dtypes) > 1 and (not self.autocast or not all(
                    tensor.dtype in _AUTOCAST_CASTS for tensor in tensors)):
                raise TypeError(f"{getattr(func, '__name__', func)} of {' and '.join(dtypes)} "
                                f"tensors: torch refuses mixed dtypes there")
        return func(*args, **kwargs)


def trace_problem(module: PipelineModule, inputs: Any, targets: Any, *,
                  autocast: bool = False) -> str | None:
    """Why one microbatch (`inputs`, `targets`: tensors or tuples of them) cannot run through
    `module`'s layers and its loss, or None when it runs or cannot be traced.

    Layers given as specs are built on the meta device (as `partition_method="parameters"`
    already does to count them); modules given built run with meta copies of their
    parameters and buffers (`torch.func.functional_call`: theirs are not touched). A layer
    whose code needs values (``.item()``, data-dependent control flow) cannot run on the meta
    device: the trace then stops without a verdict, and the ranks find any problem as
    before. A loss that would broadcast a target of another size (torch warns "Using a
    target size") counts as a problem: it trains on a silently wrong loss; so does one that
    returns anything but a one-element tensor, a GEMM of mixed dtypes (`_SameDtypeGemms`;
    `autocast`: the engine runs under mixed precision) and a `sys.exit` in a layer or the
    loss (it would end every rank; here it would end the launching process).
    """
    x = _to_meta(inputs)
    shared: dict[str, nn.Module] = {}
    with torch.no_grad(), warnings.catch_warnings(), _SameDtypeGemms(autocast):
        warnings.filterwarnings("error", message="Using a target size")
        for index in range(module.num_layers):
            layer = module.layer_definition(index)
            try:
                x = _run(layer, index, x, shared)
            except (Exception, SystemExit) as error:  # a layer may raise anything
                if _cannot_trace(error):
                    return None
                return (f"layer {index} ({_name(layer)}) fails on a microbatch of "
                        f"{_shapes(inputs)}: {_said(error)}; give inputs of the shape and "
                        f"dtype the model takes, or fix layer {index} {_SKIP_HINT}")
        if targets is None or module.loss_fn is None:
            return None
        try:
            loss = module.loss_fn(x, _to_meta(targets))
        except (Exception, SystemExit) as error:
            if _cannot_trace(error):
                return None
            return (f"loss_fn fails on the last layer's output {_shapes(x)} and targets "
                    f"{_shapes(targets)}: {_said(error)}; give targets the "
                    f"loss takes with that output {_SKIP_HINT}")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) \
                else f"{type(loss).__name__} {loss!r:.60}"
            return (f"loss_fn returns {got}, not a one-element tensor (the microbatch's loss, "
                    f"to backpropagate); return e.g. F.mse_loss(outputs, targets)")
    return None


def _said(error: BaseException) -> str:
    if isinstance(error, SystemExit):
        return f"it called sys.exit({error.code!r}), which would end every rank"
    return f"{type(error).__name__}: {error}"


def _run(layer: Layer, index: int, x: Any, shared: dict[str, nn.Module]) -> Any:
    if isinstance(layer, LayerSpec | TiedLayerSpec):
        with torch.device("meta"):
            return build_layer(layer, index, base_seed=None, shared=shared)(x)
    if isinstance(layer, nn.Module):
        state = {name: tensor.to("meta") for name, tensor in
                 [*layer.named_parameters(), *layer.named_buffers()]}
        return functional_call(layer, state, (x,))
    return build_layer(layer, index, base_seed=None)(x)  # a plain callable


def _cannot_trace(error: BaseException) -> bool:
    """Whether `error` is the meta device's limit, not the batch's problem."""
    return isinstance(error, NotImplementedError) or (
        isinstance(error, Exception) and "meta" in str(error).lower())


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
