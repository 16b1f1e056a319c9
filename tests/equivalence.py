"""Differences between a pipelined training step and the single-process reference (test helper)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pipeline.reference import ReferenceResult

__all__ = ["TOLERANCE", "describe_errors", "max_error", "new_errors", "record_step"]

TOLERANCE = 2e-5
ParamKey = tuple[int, str]


def new_errors(*extra: str) -> dict[str, float]:
    """Largest differences seen so far, per quantity: loss, grad, param (+ `extra`)."""
    return dict.fromkeys(("loss", "grad", "param", *extra), 0.0)


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def record_step(errors: dict[str, float], parameters: Iterable[tuple[ParamKey, nn.Parameter]],
                loss: float | None, expected: ReferenceResult, label: Any) -> None:
    """Fold one step into `errors`: the loss (None where this rank does not have it), every
    held parameter's gradient and its value after the optimizer step.

    Raises AssertionError when a parameter has no gradient (it took no part in the step).
    """
    if loss is not None:
        errors["loss"] = max(errors["loss"], abs(loss - expected.loss))
    for key, param in parameters:
        assert param.grad is not None, f"{label}: no gradient for layer {key}"
        errors["grad"] = max(errors["grad"], max_error(param.grad, expected.grads[key]))
        errors["param"] = max(errors["param"], max_error(param.detach(), expected.params[key]))


def describe_errors(rank: int, label: Any, errors: dict[str, float],
                    tolerance: float = TOLERANCE) -> list[str]:
    """One line per quantity that differs by more than `tolerance`."""
    return [f"rank {rank} {label}: {key} differs by {value:.3g}"
            for key, value in errors.items() if value > tolerance]
