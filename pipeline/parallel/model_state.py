"""Live bytes of one rank's model states (parameters, gradients, optimizer), counted on tensors.

Counted on the storages the tensors live in, each once: under ZeRO-1 the parameters are views
of one flat buffer (its padding counts), and fp32 masters are views of the parameters (they
cost nothing extra). Read it right after a training step: what is alive then is what the
optimizer step needed (Megatron's "bytes per parameter" of its distributed-optimizer table).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from pipeline.parallel.zero import ShardedOptimizer

__all__ = ["LiveModelStates", "count_model_states", "storage_bytes"]


@dataclass(frozen=True)
class LiveModelStates:
    """Bytes per kind of model state on one rank, each storage counted once (in the first
    kind that holds it, in the order below), and the parameters they serve."""

    parameters: int
    """The model's parameters (under ZeRO-1 its flat buffers, padding included)."""
    gradients: int
    """`.grad` tensors, main-gradient buffers, and fp32 gradient shards held apart."""
    optimizer: int
    """Optimizer state (moments, step counts) and fp32 masters held apart."""
    num_parameters: int
    """Elements of this rank's trainable parameters."""

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    @property
    def per_parameter(self) -> float:
        """Bytes per owned parameter (Megatron's unit: 16 for fp32 Adam without sharding)."""
        return self.total / max(1, self.num_parameters)


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind `tensors` not in `seen` (which is updated)."""
    seen = set() if seen is None else seen
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def count_model_states(module: nn.Module,
                       optimizer: torch.optim.Optimizer | ShardedOptimizer | None
                       ) -> LiveModelStates:
    """This rank's live model-state bytes: `module`'s parameters and gradients and what
    `optimizer` holds (its state; under ZeRO-1 also its buffers and masters)."""
    params = list(dict.fromkeys(p for p in module.parameters() if p.requires_grad))
    seen: set[int] = set()
    parameter_bytes = storage_bytes(params, seen)
    grads = [p.grad for p in params if p.grad is not None]
    state: list[torch.Tensor] = []
    inner: torch.optim.Optimizer | None
    if isinstance(optimizer, ShardedOptimizer):
        held = optimizer.held_tensors()
        parameter_bytes += storage_bytes(held["parameters"], seen)
        grads += held["gradients"]
        state += held["masters"]
        inner = optimizer.optimizer
    else:
        inner = optimizer
    if inner is not None:
        state += [value for values in inner.state.values() for value in values.values()
                  if isinstance(value, torch.Tensor)]
    gradient_bytes = storage_bytes(grads, seen)
    return LiveModelStates(parameters=parameter_bytes, gradients=gradient_bytes,
                           optimizer=storage_bytes(state, seen),
                           num_parameters=sum(p.numel() for p in params))
