"""The optimizer behind STEP: built from a factory over this rank's parameters."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

__all__ = ["OptimizerFactory", "build_optimizer", "check_optimizer_parameters",
           "make_optimizer"]

OptimizerFactory = Callable[[Sequence[torch.Tensor]], torch.optim.Optimizer]
"""``lambda params: torch.optim.SGD(params, lr=0.1)``: called once with this rank's parameters,
which it may split into groups (``[{"params": [p for p in params if p.ndim > 1], ...}]``);
under ZeRO-1 too (each group then steps its parameters' pieces of this rank's shard)."""


def make_optimizer(optimizer: OptimizerFactory | torch.optim.Optimizer | None,
                   parameters: list[nn.Parameter]) -> torch.optim.Optimizer | None:
    """The optimizer over this rank's parameters, from a factory or as given."""
    if isinstance(optimizer, torch.optim.Optimizer):
        check_optimizer_parameters(optimizer, parameters)
        return optimizer
    if optimizer is None:
        return None
    if not callable(optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or a factory taking the "
                        f"parameters, got {optimizer!r}")
    if not parameters:
        return None  # a rank of parameter-free stages has nothing to step
    return build_optimizer(optimizer, parameters)


def check_optimizer_parameters(optimizer: torch.optim.Optimizer,
                               parameters: Sequence[torch.Tensor]) -> None:
    """Refuse an optimizer built over other tensors than this rank's `parameters`: it would
    step tensors the stages never read (another model's, a copy's) and train nothing while
    the losses still come back."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    mine = {id(p) for p in parameters}
    stray, missing = len(held - mine), len(mine - held)
    if stray or missing:
        raise ValueError(
            f"the optimizer holds {len(held)} tensors, {stray} of them not parameters of this "
            f"rank's stages, and misses {missing} of its {len(mine)} parameters: it was built "
            "on other parameters (another model, or before the module was copied); pass a "
            "factory, `lambda params: torch.optim.SGD(params, lr=0.1)`, which the engine calls "
            "with this rank's parameters")


def build_optimizer(factory: OptimizerFactory,
                    parameters: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
    """``factory(parameters)``, refused unless it is a torch optimizer."""
    built = factory(parameters)
    if not isinstance(built, torch.optim.Optimizer):
        # regression: a factory returning None trained nothing, silently
        raise TypeError(f"the optimizer factory returned {built!r}, not a "
                        f"torch.optim.Optimizer; return it, e.g. "
                        f"`lambda params: torch.optim.SGD(params, lr=0.1)`")
    return built
