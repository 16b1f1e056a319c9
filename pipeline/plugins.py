"""The pluggable pieces behind REDUCE_GRAD and STEP: gradient reducers and the optimizer."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["AllReduceGradients", "GradientReducer", "NoGradientReduction", "OptimizerFactory",
           "make_optimizer"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
"""``lambda params: torch.optim.SGD(params, lr=0.1)``: called once with this rank's parameters."""


@runtime_checkable
class GradientReducer(Protocol):
    """Reduces a stage's gradients over its data-parallel replicas.

    REDUCE_GRAD calls `reduce_stage` once a step per stage, right after the stage's last
    backward (so a reducer may start asynchronous work that overlaps later instructions);
    STEP calls `finish` before the optimizer step, which must leave every gradient reduced.
    """

    def reduce_stage(self, stage: int, parameters: Sequence[nn.Parameter]) -> None: ...

    def finish(self) -> None: ...


class NoGradientReduction:
    """dp = 1: gradients are already complete."""

    def reduce_stage(self, stage: int, parameters: Sequence[nn.Parameter]) -> None:
        return None

    def finish(self) -> None:
        return None


class AllReduceGradients:
    """dp > 1 without a bucketed reducer: one asynchronous all-reduce (mean) per gradient,
    started at REDUCE_GRAD, waited at STEP."""

    def __init__(self, group: Any, size: int) -> None:
        self.group = group
        self.size = size
        self._pending: list[tuple[Any, torch.Tensor]] = []

    def reduce_stage(self, stage: int, parameters: Sequence[nn.Parameter]) -> None:
        for param in parameters:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            work = dist.all_reduce(param.grad, group=self.group, async_op=True)
            self._pending.append((work, param.grad))

    def finish(self) -> None:
        pending, self._pending = self._pending, []
        for work, grad in pending:
            work.wait()
            grad.div_(self.size)


def make_optimizer(optimizer: OptimizerFactory | torch.optim.Optimizer | None,
                   parameters: list[nn.Parameter]) -> torch.optim.Optimizer | None:
    """The optimizer over this rank's parameters, from a factory or as given."""
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if not callable(optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or a factory taking the "
                        f"parameters, got {optimizer!r}")
    if not parameters:
        return None  # a rank of parameter-free stages has nothing to step
    return optimizer(parameters)
