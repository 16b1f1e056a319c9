"""What the STEP instruction does once gradients are reduced: the vote, clipping, step.

The order is Megatron's `optimizer.step`:

    reducer.wait()          (the interpreter, before this) dp reduction and tied sums done
    1. `vote`: every rank votes on inf/NaN in its gradients (a sum over the world), so
       pipeline stages, replicas and tp shards all skip the same step (fp16: an overflow,
       which the loss scaler answers by lowering the scale)
    2. `__call__`, on the vote: fp16 unscales by the loss scale
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
from pipeline.parallel.rank_optimizer import RankOptimizer
from pipeline.parallel.zero import ShardedOptimizer

__all__ = ["GradientView", "OptimizerStep", "ReplicatedGrads", "ShardedGrads"]


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
    """The STEP instruction after `GradReducer.wait`, run once per training batch: `vote`
    (a collective every rank takes), then call it to step or skip on the vote's answer.
    `skipped` and `grad_norm` describe the last call."""

    def __init__(self, optimizer: Callable[[], RankOptimizer | None], view: GradientView, *,
                 scaler: DynamicLossScaler | None = None,
                 max_grad_norm: float | None = None,
                 finite_group: ProcessGroup | None = None,
                 link: LocalLink | None = None) -> None:
        self.optimizer = optimizer
        """Returns the optimizer at call time (a getter: it may be replaced, e.g. on load)."""
        self.view = view
        self.scaler = scaler
        self.max_grad_norm = max_grad_norm
        self.finite_group = finite_group
        """Every rank: the vote spans it."""
        self.link = link
        """The engine's datagram link (`pipeline.parallel.local_p2p`): the vote takes it
        when it spans `finite_group`."""
        self.overflow = False
        """The last vote's answer: inf or NaN in some rank's gradients."""
        self.skipped = False
        """Whether the last step was skipped (the same on every rank): fp16 overflow, or
        non-finite gradients on some rank."""
        self.nonfinite = False
        """Whether the last step's gradients held inf or NaN on some rank (fp32 / bf16; under
        fp16 that is an overflow the scaler handles, not an error)."""
        self.grad_norm: float | None = None
        """Global gradient norm before clipping at the last step (None without clipping)."""

    def vote(self, riders: torch.Tensor | None = None) -> bool:
        """Collective over `finite_group`: whether some rank's gradients hold inf or NaN (the
        same answer on every rank). `riders` (float64, CPU) are summed over the group in the
        same message, in place (`any_nonfinite`): the caller's values cost no collective of
        their own."""
        self.overflow = any_nonfinite(self.view.grads(), self.finite_group, riders, self.link)
        return self.overflow

    def __call__(self) -> None:
        """Step, or skip on every rank alike, on the last `vote`."""
        if self.scaler is None:
            # a NaN/inf gradient anywhere skips the update everywhere, so no weight is
            # corrupted and the engine can say where it began
            self.nonfinite = self.overflow
            if not self.nonfinite:
                self._apply()
            self.skipped = self.nonfinite
        else:
            self.skipped = not self.scaler.step(self.view.grads(), self._apply,
                                                overflow=self.overflow)
        self.view.clear()

    def _apply(self) -> None:
        if self.max_grad_norm is not None:
            self.grad_norm = float(self.view.clip(self.max_grad_norm))
        optimizer = self.optimizer()
        if optimizer is not None:
            optimizer.step()
