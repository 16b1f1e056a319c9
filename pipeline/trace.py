"""Measured runs: per-instruction spans, per-op costs, and the cost model they imply."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from schedules import CostModel, Kind, Span, Timeline

__all__ = ["OpCosts", "StepStats", "Trace", "measured_costs"]


class Trace:
    """This rank's spans of the current step, in seconds from the step's (aligned) start."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.origin = time.perf_counter()
        self.spans: list[Span] = []

    def restart(self) -> None:
        """Start a new step now (call right after the ranks synchronised)."""
        self.origin = time.perf_counter()
        self.spans = []

    def record(self, kind: Kind, stage: int, microbatch: int, start: float, end: float) -> None:
        """One span; `start` and `end` are `time.perf_counter()` readings."""
        self.spans.append(Span(self.rank, kind, stage, microbatch, start - self.origin,
                               end - self.origin))


@dataclass(frozen=True)
class OpCosts:
    """Mean measured seconds per op kind and stage (stages with no such op are absent)."""

    forward: dict[int, float] = field(default_factory=dict)
    backward: dict[int, float] = field(default_factory=dict)
    """Fused B (input and weight gradients)."""
    input_grad: dict[int, float] = field(default_factory=dict)
    """I: the input-gradient half of a split backward."""
    weight_grad: dict[int, float] = field(default_factory=dict)
    """W: the weight-gradient half of a split backward."""

    def cost_model(self, num_stages: int, *, comm: float = 0.0) -> CostModel:
        """A `CostModel` for the simulator: F, and B split as I + W (a fused B is all I)."""
        def per_stage(values: dict[int, float]) -> list[float]:
            fallback = float(np.mean(list(values.values()))) if values else 0.0
            return [values.get(s, fallback) for s in range(num_stages)]

        fused = bool(self.backward)
        return CostModel(forward=per_stage(self.forward),
                         backward=per_stage(self.backward if fused else self.input_grad),
                         weight=[0.0] * num_stages if fused else per_stage(self.weight_grad),
                         comm=comm)


@dataclass(frozen=True)
class StepStats:
    """What this rank measured during the last step."""

    step_time: float
    """Seconds from the aligned step start to the end of this rank's stream."""
    peak_activations: int
    """Most (stage, microbatch) activations held at once (F done, backward not yet done)."""
    recv_wait: float
    """Seconds this rank spent blocked waiting for received data."""
    costs: OpCosts
    """Mean per-op costs of this rank's stages."""


_KIND_FIELDS = {Kind.F: "forward", Kind.B: "backward", Kind.I: "input_grad",
                Kind.W: "weight_grad"}


def measured_costs(spans: Sequence[Span] | Timeline) -> OpCosts:
    """Mean duration of each compute kind per stage."""
    rows = list(spans.spans()) if isinstance(spans, Timeline) else list(spans)
    sums: dict[str, dict[int, list[float]]] = {name: {} for name in _KIND_FIELDS.values()}
    for span in rows:
        name = _KIND_FIELDS.get(span.kind)
        if name is not None:
            sums[name].setdefault(span.stage, []).append(span.end - span.start)
    means = {name: {s: float(np.mean(v)) for s, v in per.items()} for name, per in sums.items()}
    return OpCosts(**means)
