"""Emulated devices: layers whose F, I and W cost a given wall time and whose output has a size.

A rank running emulated layers behaves like an accelerator: each op *waits* its cost (the
core stays free for the other ranks on a shared CPU), so a pipeline bubble is real idle time
and a measured step time says something about the schedule, not about CPU contention.

One layer is two autograd paths joined by an add, so a split backward pays I and W apart:

    x ──_InputPath──▶ h ─┐          F: sleeps forward, returns the output of `output_elements`
                         (+) ─▶ y   I: _InputPath.backward sleeps input_grad
    θ ──_WeightPath──▶ 0 ─┘          W: _WeightPath.backward sleeps weight_grad

`torch.autograd.backward(y, inputs=x)` (I) runs only the nodes on the way to x, and
`backward(y, inputs=θ)` (W, see `pipeline.runtime.split_backward`) only those on the way
to θ; a full backward runs both. The waits are deadline based: the deadline is taken
before the op's own allocations, so their cost is absorbed into the nominal time.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from pipeline.errors import PipelineConfigError
from pipeline.model.layers import LayerSpec

__all__ = [
    "Clock",
    "EmulatedCost",
    "EmulatedLayer",
    "WallClock",
    "check_nonnegative_seconds",
    "emulated_layers",
    "emulated_loss",
]

BYTES_PER_ELEMENT = 4  # emulated tensors are float32


class Clock(Protocol):
    """Where an emulated layer reads the time and waits (a fake one in tests)."""

    def now(self) -> float:
        """Seconds on a monotonic clock at which an op issued now starts (its deadline is
        this plus its cost)."""

    def sleep_until(self, deadline: float, label: str) -> None:
        """Return at `deadline` (not before); `label` names the op ("F", "I", "W")."""


class WallClock:
    """`time.perf_counter` as an accelerator's queue: waits that end on time in total.

    Two things make a run of waits longer than the sum of their costs, and a device has
    neither:

    - `time.sleep` wakes late by a machine-dependent amount (tens of µs idle, milliseconds
      on a loaded host). The clock learns that lateness (an exponential average of the last
      wakes), sleeps that much less, then spins at most `spin_limit` for the rest;
    - the host works between two waits (the next layer's Python, the autograd engine
      between a backward's nodes: ~0.1 ms a node here), where a device would already run
      the next kernel the host queued ahead.

    So an op issued within `carry_window` of the last wake starts where the last one was
    due to end (`now`): an overshoot is repaid and the host's gap is hidden, as for kernels
    queued on a device. A longer gap (a wait for a message, a pause) starts afresh; keep
    the window below such waits, so no op starts before the data it waits for.
    """

    def __init__(self, spin_limit: float = 100e-6, carry_window: float = 250e-6, *,
                 now: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.spin_limit = spin_limit
        """Longest busy wait (s) after the sleep."""
        self.carry_window = carry_window
        """An op issued this soon (s) after the last wake starts where the last one ended."""
        self.lateness = 60e-6
        """Learned wake-up lateness of `sleep` (s)."""
        self._now, self._sleep = now, sleep
        self._last_wake = -float("inf")
        self._last_deadline = -float("inf")

    @property
    def debt(self) -> float:
        """How much the last wait overshot its deadline (s): what a back-to-back op repays."""
        return max(self._last_wake - self._last_deadline, 0.0)

    def now(self) -> float:
        now = self._now()
        if now - self._last_wake <= self.carry_window:
            return self._last_deadline  # queued behind the last op: it starts at its end
        return now

    def sleep_until(self, deadline: float, label: str) -> None:
        now = self._now()
        remaining = deadline - now
        if remaining > 0:
            asked = remaining - min(self.lateness, self.spin_limit)
            if asked > 0:
                self._sleep(asked)
                late = self._now() - now - asked
                self.lateness = min(0.9 * self.lateness + 0.1 * max(late, 0.0), 1e-3)
            while self._now() < deadline:  # the last few µs: sleep cannot hit them
                pass
        self._last_wake = self._now()
        self._last_deadline = deadline


WALL_CLOCK = WallClock()
"""The process's clock for emulated layers (one learned lateness per process)."""


@dataclass(frozen=True, kw_only=True)
class EmulatedCost:
    """What one emulated layer costs per microbatch."""

    forward: float
    """Seconds of F."""
    input_grad: float
    """Seconds of I (the input-gradient half of the backward)."""
    weight_grad: float
    """Seconds of W (the weight-gradient half); a full backward B pays I + W."""
    output_elements: int = 1
    """float32 elements of the layer's output per microbatch row (sent between stages and
    saved for the backward)."""
    param_elements: int = 1
    """float32 elements of the layer's weight."""
    rows: int | None = None
    """Rows of a whole microbatch: a call on fewer rows (a half of a two-batch forward,
    `pipeline.runtime.two_batch`) costs their share of each time. None: every call costs
    the times as given."""

    def share(self, rows: int) -> EmulatedCost:
        """The cost of a call on `rows` rows (see the field `rows`)."""
        if self.rows is None or rows == self.rows:
            return self
        part = rows / self.rows
        return dataclasses.replace(self, forward=self.forward * part,
                                   input_grad=self.input_grad * part,
                                   weight_grad=self.weight_grad * part, rows=None)

    def __post_init__(self) -> None:
        for name in ("forward", "input_grad", "weight_grad"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or \
                    not math.isfinite(value) or value < 0:
                raise PipelineConfigError(f"emulated {name} time must be a finite number of "
                                          f"seconds >= 0, got {value!r}")
        for name in ("output_elements", "param_elements", "rows"):
            value = getattr(self, name)
            if name == "rows" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PipelineConfigError(f"emulated {name} must be an int >= 1, got {value!r}")


class _InputPath(torch.autograd.Function):
    """F and I of an emulated layer: x -> a fresh output; the backward returns dL/dx."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cost: EmulatedCost, clock: Clock) -> torch.Tensor:
        # no wait here: `EmulatedLayer.forward` waits F once its whole forward is built
        ctx.input_shape, ctx.device = x.shape, x.device
        ctx.cost, ctx.clock = cost, clock
        return torch.zeros(x.shape[0] if x.dim() else 1, cost.output_elements, device=x.device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        deadline = ctx.clock.now() + ctx.cost.input_grad
        grad_input = torch.zeros(ctx.input_shape, device=ctx.device)
        ctx.clock.sleep_until(deadline, "I")
        return grad_input, None, None


class _WeightPath(torch.autograd.Function):
    """W of an emulated layer: θ -> a scalar 0 added to the output; the backward returns
    dL/dθ after waiting the weight-gradient time. It also holds the layer's output (passed
    detached, so this node is not on the input-gradient path) as the activation a real
    layer keeps for its backward."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, activation: torch.Tensor, cost: EmulatedCost,
                clock: Clock) -> torch.Tensor:
        ctx.save_for_backward(activation)
        ctx.cost, ctx.clock, ctx.device = cost, clock, weight.device
        return torch.zeros((), device=weight.device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        deadline = ctx.clock.now() + ctx.cost.weight_grad
        ctx.saved_tensors  # noqa: B018  (read, as a real weight gradient reads it)
        grad_weight = torch.zeros(ctx.cost.param_elements, device=ctx.device)
        ctx.clock.sleep_until(deadline, "W")
        return grad_weight, None, None, None


class EmulatedLayer(nn.Module):
    """A layer that costs `cost` (wall time, see the module docstring) and outputs a
    (rows, `cost.output_elements`) float32 tensor, rows = the input's first dimension.

    Its weight has `cost.param_elements` elements (its node carries W and the saved output).
    Its output is saved for the backward (one output's bytes of activation memory per
    microbatch in flight until W, or B, frees it), as a real layer saves what its backward
    reads. The model's first layer gets data as input, so its I never runs (no
    input gradient is needed): give it input_grad 0 (`pipeline.rehearsal.rehearse` does).
    """

    def __init__(self, cost: EmulatedCost, clock: Clock | None = None) -> None:
        super().__init__()
        if not isinstance(cost, EmulatedCost):
            raise TypeError(f"EmulatedLayer needs an EmulatedCost, got {cost!r}")
        self.cost = cost
        self.clock: Clock = clock if clock is not None else WALL_CLOCK
        self.weight = nn.Parameter(torch.zeros(cost.param_elements))

    def forward(self, x: Any) -> torch.Tensor:
        # the deadline first, the wait last: the layer's own host work is inside its F time
        start = self.clock.now()
        if not isinstance(x, torch.Tensor):
            x = x[0]  # a tuple between stages: the first tensor carries the batch
        if not x.is_floating_point():
            x = x.float()
        cost = self.cost.share(x.shape[0] if x.dim() else 1)
        deadline = start + cost.forward
        out = _InputPath.apply(x, cost, self.clock)
        if torch.is_grad_enabled() and self.weight.requires_grad:
            out = out + _WeightPath.apply(self.weight, out.detach(), cost, self.clock)
        self.clock.sleep_until(deadline, "F")
        return out

    def extra_repr(self) -> str:
        c = self.cost
        return (f"F={c.forward * 1e3:g} ms, I={c.input_grad * 1e3:g} ms, "
                f"W={c.weight_grad * 1e3:g} ms, output={c.output_elements}, "
                f"params={c.param_elements}")


def emulated_loss(output: Any, target: Any) -> torch.Tensor:
    """A loss for emulated models: the output's mean (its backward saves nothing)."""
    out = output if isinstance(output, torch.Tensor) else output[0]
    return out.mean()


def emulated_layers(costs: Sequence[EmulatedCost], clock: Clock | None = None
                    ) -> list[LayerSpec]:
    """One `LayerSpec(EmulatedLayer, cost)` per cost: built only on the rank that runs it."""
    if not costs:
        raise PipelineConfigError("emulated_layers needs at least one EmulatedCost")
    return [LayerSpec(EmulatedLayer, cost, clock) for cost in costs]


def check_nonnegative_seconds(costs: object, names: Sequence[str]) -> None:
    """Refuse any of `costs`' fields `names` that is not a finite number >= 0 (a bool
    included), naming the field: the emulated costs' shared check."""
    for name in names:
        value = getattr(costs, name)
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or not math.isfinite(value) or value < 0:
            raise PipelineConfigError(f"emulated {name} must be a finite number >= 0, "
                                      f"got {value!r}")
