"""Measured runs: per-instruction spans, per-op costs, and the cost model they imply."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from schedules import CostModel, Kind, Schedule, Span, Timeline

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
    """Mean measured seconds per op kind and stage (stages with no such op are absent), and
    the message latency seen by receivers that had to wait."""

    forward: dict[int, float] = field(default_factory=dict)
    backward: dict[int, float] = field(default_factory=dict)
    """Fused B (input and weight gradients)."""
    input_grad: dict[int, float] = field(default_factory=dict)
    """I: the input-gradient half of a split backward."""
    weight_grad: dict[int, float] = field(default_factory=dict)
    """W: the weight-gradient half of a split backward."""
    send_forward: dict[int, float] = field(default_factory=dict)
    """Posting the SEND_F after a stage's F (on the producer's rank)."""
    send_backward: dict[int, float] = field(default_factory=dict)
    """Posting the SEND_B after a stage's backward."""
    latency: float = 0.0
    """Median seconds from a SEND's end to the end of the receiver's wait, over the waits
    that actually blocked (0 when none did)."""

    def cost_model(self, num_stages: int) -> CostModel:
        """A `CostModel` for the simulator: F and B each with the send that follows them
        (the same rank pays it), B split as I + W (a fused B is all I), `latency` per hop."""
        def per_stage(*parts: dict[int, float]) -> list[float]:
            values = []
            for s in range(num_stages):
                total = 0.0
                for part in parts:
                    fallback = float(np.mean(list(part.values()))) if part else 0.0
                    total += part.get(s, fallback if part is parts[0] else 0.0)
                values.append(total)
            return values

        fused = bool(self.backward)
        return CostModel(
            forward=per_stage(self.forward, self.send_forward),
            backward=per_stage(self.backward if fused else self.input_grad, self.send_backward),
            weight=[0.0] * num_stages if fused else per_stage(self.weight_grad),
            comm=self.latency)


@dataclass(frozen=True)
class StepStats:
    """What this rank measured during the last step."""

    step_time: float
    """Seconds from the aligned step start to the end of this rank's stream."""
    peak_activations: int
    """Most (stage, microbatch) activations held at once (F done, backward not yet done)."""
    recv_wait: float
    """Seconds this rank spent blocked waiting for received data."""
    spans: Sequence[Span] = ()
    """The step's measured spans on this rank."""
    exposed_reduction: float = 0.0
    """Seconds in REDUCE_GRAD and in STEP's wait for the gradient reductions: reduction
    time not hidden behind compute (bucket launches inside a backward are not counted)."""
    exposed_gather: float = 0.0
    """Seconds blocked on ZeRO-1's parameter all-gathers during this step: STEP's own gather,
    or with `overlap_param_gather` the forwards' waits for the previous step's gathers."""

    @cached_property
    def costs(self) -> OpCosts:
        """Mean per-op costs of this rank's stages (worked out when first read: ~0.3 ms a
        step that most steps would spend for nothing)."""
        return measured_costs(self.spans)


_KIND_FIELDS = {Kind.F: "forward", Kind.B: "backward", Kind.OVERLAP_B: "backward",
                Kind.I: "input_grad",
                Kind.W: "weight_grad", Kind.SEND_F: "send_forward",
                Kind.SEND_B: "send_backward"}
_PRODUCER = {Kind.RECV_F: (Kind.SEND_F, -1), Kind.RECV_B: (Kind.SEND_B, +1)}
_BLOCKED = 50e-6  # a wait shorter than this found its data already there


def measured_costs(spans: Sequence[Span] | Timeline) -> OpCosts:
    """Mean duration of each compute kind (and send) per stage, and the message latency."""
    rows = list(spans.spans()) if isinstance(spans, Timeline) else list(spans)
    sums: dict[str, dict[int, list[float]]] = {name: {} for name in _KIND_FIELDS.values()}
    send_end: dict[tuple[Kind, int, int], float] = {}
    for span in rows:
        name = _KIND_FIELDS.get(span.kind)
        if name is not None:
            sums[name].setdefault(span.stage, []).append(span.end - span.start)
        if span.kind in (Kind.SEND_F, Kind.SEND_B):
            send_end[(span.kind, span.stage, span.microbatch)] = span.end
    latencies = []
    for span in rows:
        producer = _PRODUCER.get(span.kind)
        if producer is None or span.end - span.start < _BLOCKED:
            continue
        sent = send_end.get((producer[0], span.stage + producer[1], span.microbatch))
        if sent is not None:
            latencies.append(max(0.0, span.end - sent))
    means = {name: {s: float(np.mean(v)) for s, v in per.items()} for name, per in sums.items()}
    return OpCosts(**means, latency=float(np.median(latencies)) if latencies else 0.0)


def merge_rank_spans(gathered: Sequence[tuple[str, float, Sequence[Span]]],
                     schedule: Schedule) -> Timeline:
    """Every pipeline rank's (host, clock origin, spans) of one step as one `Timeline`.

    Ranks on one host share the monotonic clock, so their spans are placed on it exactly;
    across hosts each rank's clock starts at the step's opening collective.
    """
    same_host = len({host for host, _, _ in gathered}) == 1
    first = min(origin for _, origin, _ in gathered)
    spans: list[Span] = []
    for _, origin, rank_spans in gathered:
        shift = origin - first if same_host else 0.0
        spans += [span._replace(start=span.start + shift, end=span.end + shift)
                  for span in rank_spans]
    return Timeline.from_spans(spans, schedule.num_ranks, name=f"{schedule.name} (measured)",
                               num_microbatches=schedule.num_microbatches,
                               chunks=schedule.chunks, unit="s")
