"""A stage's loss function called on one microbatch, refusing what would silently mislead."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from pipeline.model.module import LossFn

__all__ = ["call_loss"]

_BROADCAST_WARNING = r"Using a target size .* that is different to the input size"


def _name(function: Any) -> str:
    return getattr(function, "__qualname__", None) or type(function).__name__


def _shape(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return str(tuple(value.shape))
    if isinstance(value, tuple | list):
        return "(" + ", ".join(_shape(item) for item in value) + ")"
    return type(value).__name__


def call_loss(loss_fn: LossFn, out: Any, target: Any) -> torch.Tensor:
    """`loss_fn(out, target)`, refusing a broadcast of mismatched shapes (torch's
    regression losses warn, then broadcast outputs (8, 4) against targets (8, 1) into a loss
    of the wrong meaning) and anything but a one-element tensor."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=_BROADCAST_WARNING, category=UserWarning)
        try:
            loss = loss_fn(out, target)
        except UserWarning as warning:
            raise ValueError(
                f"loss_fn {_name(loss_fn)} got outputs of shape {_shape(out)} and "
                f"targets of shape {_shape(target)}, which torch would broadcast ({warning}); "
                "give targets of the outputs' shape") from None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = f"a tensor of shape {_shape(loss)}" if isinstance(loss, torch.Tensor) \
            else f"{type(loss).__name__} {loss!r:.60}"
        raise TypeError(f"loss_fn {_name(loss_fn)} must return a one-element tensor "
                        f"(the microbatch's loss, to backpropagate), got {got}; return "
                        "e.g. F.mse_loss(outputs, targets), not loss.item()")
    return loss
