"""Telling a summed loss from a mean one by calling it: the same items twice sum to twice the
loss and average to the same loss."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

__all__ = ["summed_loss_problem"]


def _twice(value: Any) -> Any:
    """Every tensor with a batch dimension repeated along it (the batch seen twice)."""
    def double(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() == 0:
                raise ValueError("a tensor without a batch dimension")
            return torch.cat([leaf.detach(), leaf.detach()])
        return leaf
    return tree_map(double, value)


def summed_loss_problem(loss_fn: Callable[[Any, Any], torch.Tensor], outputs: Any,
                        targets: Any, loss: torch.Tensor) -> str | None:
    """Why `loss_fn` cannot train in a pipeline when, called on the microbatch twice over,
    it returns twice `loss` (it sums over items, e.g. ``F.mse_loss(out, y,
    reduction="sum")`` in a lambda); None when it averages or the probe cannot tell (a loss
    of zero, inputs it cannot double, a loss that is neither)."""
    one = float(loss.detach())
    if not math.isfinite(one) or abs(one) < 1e-12:
        return None
    try:
        with torch.no_grad():
            two = float(loss_fn(_twice(outputs), _twice(targets)))
    except Exception:  # a loss that cannot take a doubled batch: the probe cannot tell
        return None
    if not math.isclose(two, 2 * one, rel_tol=1e-4):
        return None
    return (f"loss_fn {getattr(loss_fn, '__qualname__', repr(loss_fn))} sums over items: on "
            f"a microbatch seen twice it returned {two:.6g}, twice its {one:.6g}; the engine "
            "averages the m microbatch losses, which for sums is neither the single-process "
            "sum nor the mean; use reduction='mean', or a "
            "pipeline.runtime.loss_normalization.SummedLoss(loss_sum, count) (e.g. "
            "token_cross_entropy()) which the engine normalises by the step's item count")
