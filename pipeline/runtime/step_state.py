"""What one rank's step holds between instructions: the forward's saved roots and leaves, the
messages in flight, the losses; empty again when the step ends."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeline.runtime.batch import Batch, Layout
from pipeline.runtime.comm import PendingRecv
from pipeline.runtime.finite import FiniteFlag
from pipeline.runtime.pulled_batch import PulledHalf
from pipeline.runtime.split_backward import LayerGrads

__all__ = ["Key", "SavedForward", "StepState"]

Key = tuple[int, int]  # (stage, microbatch)


@dataclass
class SavedForward:
    """What a backward needs from its forward: autograd roots and the leaves to read."""

    leaves: list[torch.Tensor]
    """The stage input's floating tensors (leaves requiring grad); empty on stage 0."""
    roots: list[torch.Tensor]
    """Tensors to differentiate: the scaled loss, or the output tensors requiring grad."""
    root_index: list[int]
    """Position of each root among the output's floating tensors (grads arrive for all)."""
    grad_layout: Layout
    """Every floating output tensor's shape and dtype: the incoming gradient's layout."""
    root_grads: list[torch.Tensor] | None = None
    """Kept from I for W."""
    layer_grads: LayerGrads | None = None
    """Per-layer output gradients I leaves for W (split backward only)."""
    held_outputs: list[Any] = field(default_factory=list)
    """The roots as an active `SavedTensorMeter` counts them (`hold_outputs`)."""


@dataclass
class StepState:
    """Everything one step holds between instructions; empty again when the step ends."""

    microbatches: Sequence[Batch] | PulledHalf | None
    """Input microbatch i, read once by its LOAD (first stage; pulled then from a
    data iterator)."""
    targets: Sequence[Any] | PulledHalf | None
    """Target microbatch i, read once (last stage)."""
    training: bool
    step: int = 0
    """The engine's `global_step`: with the microbatch, the key of layers' random streams."""
    first_microbatch: int = 0
    """Global index of this rank's microbatch 0 (dp_rank · m): replicas draw other masks."""
    inputs: dict[Key, Batch] = field(default_factory=dict)
    loaded_targets: dict[int, Any] = field(default_factory=dict)
    saved: dict[Key, SavedForward] = field(default_factory=dict)
    recv_f: dict[Key, tuple[PendingRecv, bool]] = field(default_factory=dict)
    recv_b: dict[Key, PendingRecv] = field(default_factory=dict)
    out_grads: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    send_f: dict[Key, Batch] = field(default_factory=dict)
    send_b: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)
    outputs: dict[int, Batch] = field(default_factory=dict)
    peak_activations: int = 0
    recv_wait: float = 0.0
    exposed_reduction: float = 0.0
    """Seconds spent in REDUCE_GRAD and in STEP's wait for the gradient reductions."""
    finite: list[FiniteFlag] = field(default_factory=list)
    """Whether each forward output and loss was finite, read only if the step's loss or
    gradients are not (`first_nonfinite`)."""
    loss_sum: torch.Tensor | None = None
    """The step's mean loss summed over the world (each data-parallel replica's once), once
    summed: at STEP, riding its vote's message; without STEP, by the engine after the run."""

    def leftovers(self) -> dict[str, int]:
        """Per-step entries still held (all empty after a complete step)."""
        held: dict[str, dict[Any, Any]] = {
            "inputs": self.inputs, "targets": self.loaded_targets, "saved": self.saved,
            "recv_f": self.recv_f, "recv_b": self.recv_b, "out_grads": self.out_grads,
            "send_f": self.send_f, "send_b": self.send_b}
        return {name: len(entries) for name, entries in held.items() if entries}
