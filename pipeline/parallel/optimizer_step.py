"""What the STEP instruction does once gradients are reduced: overflow vote, clipping, step.

The order is Megatron's `optimizer.step`:

    reducer.wait()          (the interpreter, before this) dp reduction and tied sums done
    1. fp16 only: every rank votes on inf/NaN in its gradients (MAX all-reduce over the
       world), so pipeline stages, replicas and tp shards all skip the same step
    2. unscale by the loss scale
    3. clip by the global norm over every rank
    4. optimizer step (ZeRO-1: step this rank's shard, all-gather the parameters)
    5. clear gradients: always under ZeRO-1, whose per-region "reduced" marks must be reset
       even when the step was skipped

Gradients are seen through a `GradientView`: replicated gradients (plain data parallel,
reduced in place on every replica) or ZeRO-1 shards (each rank holds 1/dp of them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn
from torch.distributed import ProcessGroup

from pipeline.parallel.local_p2p import LocalLink
from pipeline.parallel.precision import (
    DynamicLossScaler,
    any_nonfinite,
    clip_grad_norm_global,
    global_grad_norm,
)
from pipeline.parallel.zero import ShardedOptimizer

__all__ = ["GradientView", "OptimizerStep", "ReplicatedGrads", "ShardedGrads", "StepOptimizer"]

StepOptimizer = torch.optim.Optimizer | ShardedOptimizer
"""What STEP steps: a torch optimizer over this rank's parameters, or ZeRO-1's shards."""


class GradientView(Protocol):
    """The gradients one rank's step acts on, after the reduction."""

    def grads(self) -> list[torch.Tensor]:
        """The tensors the overflow vote checks and unscaling scales."""
        ...

    def clip(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients to a global norm of at most `max_norm` (collective); return
        the norm before clipping, equal on every rank."""
        ...

    def clear(self) -> None:
        """Forget this step's gradients where the next step requires it."""
        ...


class ReplicatedGrads:
    """Gradients held whole on every data-parallel replica (plain dp or none).

    The norm is summed over the model-parallel group (pp × tp of one replica): replicas hold
    equal gradients and must not be counted dp times. Gradients stay on the parameters after
    the step (the engine clears them when the next batch starts), so they can be read.
    """

    def __init__(self, params: Sequence[nn.Parameter], norm_group: ProcessGroup | None,
                 tp_rank: int) -> None:
        self.params = list(params)
        self.norm_group = norm_group
        self.tp_rank = tp_rank

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def clip(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm_global(self.params, max_norm, self.norm_group,
                                     tp_rank=self.tp_rank)

    def clear(self) -> None:
        pass


class ShardedGrads:
    """ZeRO-1: each rank holds the reduced gradient of its 1/dp shard only.

    The norm is summed over the world (shards are disjoint). A rank without trainable
    parameters has no `ShardedOptimizer` but still joins the norm's all-reduce.
    """

    def __init__(self, optimizer: ShardedOptimizer | None, world_group: ProcessGroup | None,
                 tp_rank: int) -> None:
        self.optimizer = optimizer
        self.world_group = world_group
        self.tp_rank = tp_rank

    def grads(self) -> list[torch.Tensor]:
        return [] if self.optimizer is None else self.optimizer.grad_shards()

    def clip(self, max_norm: float) -> torch.Tensor:
        if self.optimizer is None:
            return global_grad_norm([], self.world_group)
        return self.optimizer.clip_grad_norm_(max_norm, self.world_group, tp_rank=self.tp_rank)

    def clear(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad()


class OptimizerStep:
    """The STEP instruction after `GradReducer.wait`: a callable the interpreter runs once
    per training batch. `skipped` and `grad_norm` describe the last call."""

    def __init__(self, optimizer: Callable[[], StepOptimizer | None], view: GradientView, *,
                 scaler: DynamicLossScaler | None = None,
                 max_grad_norm: float | None = None,
                 finite_group: ProcessGroup | None = None) -> None:
        self.optimizer = optimizer
        """Returns the optimizer at call time (a getter: it may be replaced, e.g. on load)."""
        self.view = view
        self.scaler = scaler
        self.max_grad_norm = max_grad_norm
        self.finite_group = finite_group
        """Every rank: without fp16's scaler, the non-finite vote spans it."""
        self.link: LocalLink | None = None
        """The engine's datagram link (`pipeline.parallel.local_p2p`): the vote takes it
        when it spans `finite_group`."""
        self.skipped = False
        """Whether the last step was skipped (the same on every rank): fp16 overflow, or
        non-finite gradients on some rank."""
        self.nonfinite = False
        """Whether the last step's gradients held inf or NaN on some rank (fp32 / bf16)."""
        self.grad_norm: float | None = None
        """Global gradient norm before clipping at the last step (None without clipping)."""

    def __call__(self, riders: torch.Tensor | None = None) -> bool:
        """Step (or skip, on every rank alike); returns whether `riders` were summed over
        the world in the step's vote (`any_nonfinite`): fp32 and bf16, not fp16."""
        shared = False
        if self.scaler is None:
            # the vote every rank takes alike: a NaN/inf gradient anywhere skips the update
            # everywhere, so no weight is corrupted and the engine can say where it began
            self.nonfinite = any_nonfinite(self.view.grads(), self.finite_group, riders,
                                           self.link)
            shared = riders is not None
            if not self.nonfinite:
                self._apply()
            self.skipped = self.nonfinite
        else:
            self.skipped = not self.scaler.step(self.view.grads(), self._apply)
        self.view.clear()
        return shared

    def _apply(self) -> None:
        if self.max_grad_norm is not None:
            self.grad_norm = float(self.view.clip(self.max_grad_norm))
        optimizer = self.optimizer()
        if optimizer is not None:
            optimizer.step()
