"""Emulated MoE blocks: timed attention and experts, dispatch and combine timed on a lane.

An emulated device (`pipeline.rehearsal.emulated`) with an expert all-to-all: the rank's
all-to-all link is a lane of timed waits that runs beside its compute. An exchange launched
at t, when the lane is free from f, is in flight over [max(t, f), max(t, f) + cost]; the
op that launched it waits for its end through `interleave.hand_over`, so inside an
overlapped pair (DualPipe's F&B) the other microbatch computes meanwhile. No rank waits for
a peer's tokens: the lane stands for the ep group's all-to-all at a given cost (on one host
the ep ranks would share the cores that the emulation keeps free).

One MoE block, each part costing t (forward) per microbatch::

    attention (EmulatedLayer) ─▶ dispatch (lane) ─▶ experts (EmulatedLayer) ─▶ combine (lane)
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pipeline.errors import PipelineConfigError
from pipeline.model.layers import LayerSpec
from pipeline.moe.interleave import hand_over
from pipeline.rehearsal.emulated import WALL_CLOCK, EmulatedCost, EmulatedLayer, WallClock

__all__ = ["AllToAllLane", "EmulatedAllToAll", "InFlightWait", "emulated_moe_blocks"]


class InFlightWait:
    """An emulated all-to-all in flight until `deadline`."""

    def __init__(self, clock: WallClock, deadline: float) -> None:
        self.clock, self.deadline = clock, deadline

    def wait(self) -> None:
        # a wait already over leaves the compute stream where it is (never earlier)
        if self.deadline > self.clock.now():
            self.clock.sleep_until(self.deadline, "all-to-all")


class AllToAllLane:
    """A rank's all-to-all link: one exchange at a time, in launch order."""

    def __init__(self, clock: WallClock = WALL_CLOCK) -> None:
        self.clock = clock
        self._free = -math.inf

    def launch(self, seconds: float) -> InFlightWait:
        start = max(self.clock.now(), self._free)
        self._free = start + seconds
        return InFlightWait(self.clock, self._free)


LANE = AllToAllLane()
"""The process's all-to-all lane (one per emulated device)."""


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward: float, backward: float,
                lane: AllToAllLane) -> torch.Tensor:
        ctx.backward_seconds, ctx.lane = backward, lane
        hand_over(lane.launch(forward))
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        hand_over(ctx.lane.launch(ctx.backward_seconds))
        return grad.clone(), None, None, None


class EmulatedAllToAll(nn.Module):
    """A dispatch or combine: `forward` seconds on the lane in F, `backward` in B (or I)."""

    all_to_all_inside = True
    """Its waits go through `interleave.hand_over` (the engine interleaves overlapped pairs)."""

    def __init__(self, forward: float, backward: float, lane: AllToAllLane | None = None,
                 rows: int | None = None) -> None:
        super().__init__()
        for name, value in (("forward", forward), ("backward", backward)):
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not math.isfinite(value) or value < 0:
                raise PipelineConfigError(f"emulated all-to-all {name} time must be a finite "
                                          f"number of seconds >= 0, got {value!r}")
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int)
                                 or rows < 1):
            raise PipelineConfigError(f"emulated all-to-all rows must be an int >= 1 or None, "
                                      f"got {rows!r}")
        self.forward_seconds, self.backward_seconds = float(forward), float(backward)
        self.lane = lane if lane is not None else LANE
        self.rows = rows
        """Rows of a whole microbatch: fewer rows (half of a two-batch forward) exchange
        their share of the time (`EmulatedCost.rows`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = 1.0 if self.rows is None else (x.shape[0] if x.dim() else 1) / self.rows
        out: torch.Tensor = _Exchange.apply(x, self.forward_seconds * part,
                                            self.backward_seconds * part, self.lane)
        return out


def emulated_moe_blocks(num_blocks: int, part: float, *, backward_part: float,
                        elements: int = 1024, rows: int | None = None,
                        dense: frozenset[int] = frozenset()) -> list[LayerSpec]:
    """`num_blocks` MoE blocks (module docstring), each part of F costing `part` seconds;
    a compute part's backward costs `backward_part` (half I, half W), an exchange's
    `part` (the same tokens go back). The model's first layer has no input gradient.
    `rows`: a microbatch's rows, where a call on fewer costs its share (two-batch halves).
    Blocks in `dense` have no experts' exchanges (an `nn.Identity` in each exchange's place,
    so every block keeps four layers): a dense transformer block of the same compute."""
    layers: list[LayerSpec] = []
    for block in range(num_blocks):
        for compute in ("attention", "experts"):
            first = block == 0 and compute == "attention"
            cost = EmulatedCost(forward=part, input_grad=0.0 if first else backward_part / 2,
                                weight_grad=backward_part / 2, output_elements=elements,
                                param_elements=elements, rows=rows)
            layers.append(LayerSpec(EmulatedLayer, cost))
            layers.append(LayerSpec(nn.Identity) if block in dense
                          else LayerSpec(EmulatedAllToAll, part, part, None, rows))
    return layers
