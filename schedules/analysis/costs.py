"""The simulator's cost model: per-stage op times, message costs, and the data-parallel
gradient reduction and parameter gather laid on each rank's communication lane."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from schedules.analysis.all_to_all import ExpertAllToAll
from schedules.analysis.reduction import REDUCTION_STARTS, ReductionStart
from schedules.ir.errors import ScheduleConfigError

__all__ = ["CostModel", "GradReduction", "ParamGather", "PerStage", "per_stage"]

PerStage = float | Sequence[float]


def per_stage(name: str, value: PerStage, num_stages: int) -> list[float]:
    values = [float(value)] * num_stages if isinstance(value, int | float) else \
        [float(x) for x in value]
    if len(values) != num_stages:
        raise ScheduleConfigError(
            f"{name} has {len(values)} values but the schedule has {num_stages} stages; "
            "give one number, or one per stage")
    bad = [x for x in values if not math.isfinite(x) or x < 0]
    if bad:
        raise ScheduleConfigError(f"{name} must be finite and >= 0, got {bad[0]!r}")
    return values


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _checkper_stage(name: str, value: object) -> None:
    """A number, or numbers one per stage, each finite and >= 0 (checked when the model is
    made, so a bad cost fails where it is written, not inside a simulation)."""
    if _is_number(value):
        values: list[object] = [value]
    elif isinstance(value, Iterable) and not isinstance(value, str | bytes):
        values = list(value)
    else:
        values = [None]
    if not all(isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
               and float(x) >= 0 for x in values):
        raise ScheduleConfigError(f"{name} must be finite and >= 0 (a number, or a list of "
                                  f"one per stage), got {value!r}")


def _check_counts(name: str, value: object, *, optional: bool = False) -> None:
    counts = [value] if isinstance(value, int) else value
    if optional and value is None:
        return
    if not isinstance(counts, Sequence) or not counts or not all(
            isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in counts):
        raise ScheduleConfigError(f"{name} must be a whole number >= 1 (or one per stage), "
                                  f"got {value!r}")


def _counts(name: str, value: int | Sequence[int], num_stages: int) -> list[int]:
    counts = [value] * num_stages if isinstance(value, int) else list(value)
    if len(counts) != num_stages:
        raise ScheduleConfigError(f"{name} has {len(counts)} values but the schedule has "
                                  f"{num_stages} stages; give one number, or one per stage")
    return counts


@dataclass(frozen=True, kw_only=True)
class GradReduction:
    """The data-parallel gradient reduction of every stage, placed on each rank's timeline by
    the engine's rule (`schedules.analysis.reduction`)."""

    time: PerStage
    """Time of one stage's whole reduction (its all-reduce; under ZeRO-1 its reduce-scatter),
    a number for every stage or one per stage."""
    buckets: int | Sequence[int] = 1
    """Buckets a stage's gradients are reduced in (the engine's `bucket_mb`), a number for
    every stage or one per stage."""
    start: ReductionStart = "overlap"
    """overlap: buckets launch from the hooks of the stage's last fused backward as they
    become final (`overlap_grad_reduce=True`); after_backward: at the stage's REDUCE_GRAD
    (`overlap_grad_reduce=False`); after_flush: when the rank's compute ends."""

    def __post_init__(self) -> None:
        _checkper_stage("reduction time", self.time)
        _check_counts("buckets", self.buckets)
        if self.start not in REDUCTION_STARTS:
            raise ScheduleConfigError(f"start must be one of {', '.join(REDUCTION_STARTS)}, "
                                      f"got {self.start!r}")

    def resolve(self, num_stages: int) -> tuple[list[float], list[int]]:
        """Reduction time and bucket count, one per stage."""
        return (per_stage("reduction time", self.time, num_stages),
                _counts("buckets", self.buckets, num_stages))


@dataclass(frozen=True, kw_only=True)
class ParamGather:
    """ZeRO-1's parameter all-gather of every stage after the optimizer step, placed on each
    rank's communication lane by the engine's rule (`schedules.analysis.gather`)."""

    time: PerStage
    """Time of one stage's whole all-gather, a number for every stage or one per stage."""
    buckets: int | Sequence[int] = 1
    """Buckets a stage's parameters are gathered in (its reduction's buckets)."""
    overlap: bool = False
    """False: after the rank's reduction, at STEP, all exposed (the engine's default); True:
    the previous step's gathers run from the step's start and each stage's first forward
    waits for its buckets (`overlap_param_gather=True`)."""
    layers: int | Sequence[int] | None = None
    """Equal layers of a stage, each waiting for the buckets holding its parameters, a
    number for every stage or one per stage; None: as many as buckets (the finest wait)."""

    def __post_init__(self) -> None:
        _checkper_stage("gather time", self.time)
        _check_counts("buckets", self.buckets)
        _check_counts("layers", self.layers, optional=True)
        if not isinstance(self.overlap, bool):
            raise ScheduleConfigError(f"overlap must be True or False, got {self.overlap!r}")

    def resolve(self, num_stages: int) -> tuple[list[float], list[int], list[int | None]]:
        """Gather time, bucket count and layers (None: unset), one per stage."""
        layers: list[int | None] = [None] * num_stages if self.layers is None else \
            list(_counts("layers", self.layers, num_stages))
        return (per_stage("gather time", self.time, num_stages),
                _counts("buckets", self.buckets, num_stages), layers)


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Per-stage op times (a number for every stage, or one per stage) and message costs."""

    forward: PerStage = 1.0
    """Time of F on a stage."""
    backward: PerStage = 1.0
    """Time of the input-gradient backward (I); a fused B costs backward + weight."""
    weight: PerStage = 1.0
    """Time of the weight-gradient backward (W)."""
    comm: float = 0.0
    """Latency added to every dependency between ops on different ranks."""
    activation_bytes: PerStage = 0.0
    """Bytes of one microbatch's output activation (and of its gradient), per stage."""
    bandwidth: float | None = None
    """Bytes per time unit on a link; None makes bytes free (only `comm` is charged)."""
    overlap: float = 1.0
    """Time of an overlapped pair (F, then OVERLAP_B: DualPipe's F&B) as a fraction of F + B
    back to back: 1 gains nothing; below 1 when one op's compute hides the other's
    communication (DualPipe's point)."""
    reduction: GradReduction | None = None
    """The data-parallel gradient reduction; None: none (the timeline holds compute only)."""
    gather: ParamGather | None = None
    """ZeRO-1's parameter all-gather after the step; None: none."""
    all_to_all: ExpertAllToAll | None = None
    """The MoE stages' expert all-to-all inside each F and B (I), on each rank's all-to-all
    lane: exposed in an op run alone (F costs forward + all_to_all.forward; with `two_batch`,
    an F's two halves hide part of it), interleaved with the other op's compute in an
    overlapped pair (`schedules.analysis.all_to_all`, which then prices the pair instead of
    `overlap`); None: none."""

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "weight", "activation_bytes"):
            _checkper_stage(name, getattr(self, name))
        if not _is_number(self.comm) or not math.isfinite(self.comm) or self.comm < 0:
            raise ScheduleConfigError(f"comm must be finite and >= 0, got {self.comm!r}")
        if not _is_number(self.overlap) or not math.isfinite(self.overlap) or self.overlap < 0:
            raise ScheduleConfigError(f"overlap must be a finite fraction >= 0 of F + B, got "
                                      f"{self.overlap!r}")
        if self.bandwidth is not None and not (_is_number(self.bandwidth) and
                                               self.bandwidth > 0 and math.isfinite(
                self.bandwidth)):
            raise ScheduleConfigError(f"bandwidth must be > 0 or None, got {self.bandwidth!r}")
        if self.reduction is not None and not isinstance(self.reduction, GradReduction):
            raise ScheduleConfigError(f"reduction must be a schedules.GradReduction or None, "
                                      f"got {self.reduction!r}")
        if self.gather is not None and not isinstance(self.gather, ParamGather):
            raise ScheduleConfigError(f"gather must be a schedules.ParamGather or None, "
                                      f"got {self.gather!r}")
        if self.all_to_all is not None:
            if not isinstance(self.all_to_all, ExpertAllToAll):
                raise ScheduleConfigError(f"all_to_all must be a schedules.analysis.all_to_all."
                                          f"ExpertAllToAll or None, got {self.all_to_all!r}")
            _checkper_stage("all_to_all.forward", self.all_to_all.forward)
            _checkper_stage("all_to_all.backward", self.all_to_all.backward)
            if not isinstance(self.all_to_all.two_batch, bool):
                raise ScheduleConfigError(f"all_to_all.two_batch must be True or False, got "
                                          f"{self.all_to_all.two_batch!r}")
            if self.overlap != 1.0:
                raise ScheduleConfigError(
                    f"give overlap={self.overlap!r} or all_to_all, not both: with the expert "
                    "all-to-all the overlapped pair is priced from it (overlap must stay 1)")

    def resolve(self, num_stages: int) -> tuple[list[float], list[float], list[float],
                                                 list[float], list[float]]:
        """forward, backward, weight, per-edge delay and activation bytes, one per stage."""
        forward = per_stage("forward", self.forward, num_stages)
        backward = per_stage("backward", self.backward, num_stages)
        weight = per_stage("weight", self.weight, num_stages)
        act = per_stage("activation_bytes", self.activation_bytes, num_stages)
        per_byte = 0.0 if self.bandwidth is None else 1.0 / self.bandwidth
        delay = [self.comm + nbytes * per_byte for nbytes in act]
        return forward, backward, weight, delay, act
