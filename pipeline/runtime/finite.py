"""Where a training step's inf/NaN first appeared: flags recorded during the step, read only
when its loss or gradients are not finite."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipeline.errors import NonFiniteError
from pipeline.runtime.batch import Batch, as_tensors

__all__ = ["FiniteFlag", "all_finite", "first_nonfinite", "nonfinite_error"]

FiniteFlag = tuple[int, int, str, torch.Tensor]
"""(stage, microbatch, 'output' or 'loss', a 0-dim bool tensor: all finite)."""


def first_nonfinite(flags: Sequence[FiniteFlag]) -> tuple[int, int, str] | None:
    """The earliest (stage, microbatch, what) whose values were not finite, or None."""
    bad = [(stage, microbatch, what) for stage, microbatch, what, flag in flags
           if not bool(flag)]
    return min(bad) if bad else None


def nonfinite_error(first: tuple[int, int, str] | None, loss: float, step: int, *,
                    skipped: bool) -> NonFiniteError:
    """The error naming where a step's inf/NaN first appeared (None: in gradients only)."""
    stage, microbatch, what = first if first is not None else (-1, -1, "gradients")
    place = (f"the {what} of stage {stage}, microbatch {microbatch}" if stage >= 0 else
             "the gradients only (every stage output and loss was finite)")
    update = ("the update was skipped on every rank" if skipped else
              "the gradients were finite, so the update was applied")
    return NonFiniteError(
        f"step {step}: loss {loss} is not finite; the first inf/NaN appeared in {place}; "
        f"{update}. Check that stage's inputs and the learning rate, or pass "
        f"on_nonfinite='skip' to go on past such steps",
        stage=stage, microbatch=microbatch, where=what)


def _finite(tensor: torch.Tensor) -> torch.Tensor:
    # the extremes are finite iff every element is (NaN propagates through aminmax):
    # `torch.isfinite(t).all()` makes an abs copy and three bool tensors of t's size (on
    # CPU), which sit at the forward's peak; this allocates nothing of that size
    if tensor.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    low, high = torch.aminmax(tensor)
    return torch.isfinite(low) & torch.isfinite(high)


def all_finite(value: Batch) -> torch.Tensor:
    """A 0-dim bool tensor: whether every floating tensor of `value` is finite (no sync)."""
    flags = [_finite(t.detach()) for t in as_tensors(value, "a stage's output")
             if t.is_floating_point()]
    if len(flags) == 1:
        return flags[0]  # most stages pass one tensor: no stack (~15 µs an op)
    return torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool)
