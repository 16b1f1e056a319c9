"""Memory per rank predicted from a schedule: parameters, gradients, optimizer state, activations.

Legend: p ranks, m microbatches, S stages (p·v), dp data-parallel replicas. A stage's
activations for one microbatch are allocated when its F starts and freed when its last
backward op ends (B, or W when the backward is split; I keeps them, since W still reads
what the forward saved). A rank runs its ops one at a time, so its peak depends only on
the order of its stream, not on timing: the running sum is taken after every F.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from schedules.ir.errors import ScheduleConfigError
from schedules.ir.instructions import Kind
from schedules.ir.schedule import Schedule

__all__ = ["MemoryModel", "RankMemory", "predict_memory"]

PerStage = float | Sequence[float]


def _per_stage(name: str, value: PerStage, num_stages: int) -> list[float]:
    values = [value] * num_stages if isinstance(value, int | float) else list(value)
    if len(values) != num_stages:
        raise ScheduleConfigError(f"{name} has {len(values)} values but the schedule has "
                                  f"{num_stages} stages; give one number, or one per stage")
    for x in values:
        if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x) \
                or x < 0:
            raise ScheduleConfigError(f"{name} must be finite numbers of bytes >= 0, got {x!r}")
    return [float(x) for x in values]


@dataclass(frozen=True, kw_only=True)
class MemoryModel:
    """Bytes per stage and the training setup that decides what each rank keeps."""

    params: PerStage = 0.0
    """Parameter bytes of a stage (a number for every stage, or one per stage)."""
    saved: PerStage = 0.0
    """Activation bytes one microbatch leaves saved on a stage until its backward ends."""
    data_parallel: int = 1
    """Replicas dp; under ZeRO-1 each holds 1/dp of the optimizer state."""
    zero_stage: int = 0
    """0: every replica keeps the whole optimizer state. 1: sharded over dp, as pipesched's
    ZeRO-1 holds it: besides the parameters' own gradients, a flat reduce buffer (one more
    gradient's bytes) and the reduced 1/dp shard; an fp32 master copy of the 1/dp parameter
    shard besides the optimizer state."""
    optimizer_factor: float = 2.0
    """Optimizer-state bytes per parameter byte (Adam: two moments = 2; SGD: 0)."""
    gradient_factor: float = 1.0
    """Gradient bytes per parameter byte (1: gradients in the parameters' dtype)."""

    def __post_init__(self) -> None:
        if isinstance(self.data_parallel, bool) or not isinstance(self.data_parallel, int) \
                or self.data_parallel < 1:
            raise ScheduleConfigError(f"data_parallel must be an int >= 1, got "
                                      f"{self.data_parallel!r}")
        if self.zero_stage not in (0, 1):
            raise ScheduleConfigError(f"zero_stage must be 0 or 1, got {self.zero_stage!r}")
        for name in ("optimizer_factor", "gradient_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or \
                    not math.isfinite(value) or value < 0:
                raise ScheduleConfigError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class RankMemory:
    """Predicted (or measured) bytes on one pipeline rank."""

    rank: int
    params: float
    gradients: float
    optimizer: float
    activations: float
    """Peak bytes of saved activations."""
    peak_in_flight: int
    """Microbatch activations held at that peak (count of (stage, microbatch) pairs)."""

    @property
    def total(self) -> float:
        """Everything at the activation peak (gradients are counted whole: they accumulate
        over the step)."""
        return self.params + self.gradients + self.optimizer + self.activations

    def to_dict(self) -> dict[str, float]:
        return {"rank": self.rank, "params": self.params, "gradients": self.gradients,
                "optimizer": self.optimizer, "activations": self.activations,
                "peak_in_flight": self.peak_in_flight, "total": self.total}


def _activation_peak(stream: Sequence[tuple[Kind, int, int]],
                     saved: Sequence[float]) -> tuple[float, int]:
    """(peak bytes, microbatches held then) of one rank's compute stream."""
    held, count, peak, peak_count = 0.0, 0, 0.0, 0
    for kind, stage, _ in stream:
        if kind is Kind.F:
            held += saved[stage]
            count += 1
            if held > peak or (held == peak and count > peak_count):
                peak, peak_count = held, count
        elif kind is Kind.B or kind is Kind.OVERLAP_B or kind is Kind.W:
            held -= saved[stage]
            count -= 1
    return peak, peak_count


def predict_memory(schedule: Schedule, model: MemoryModel) -> tuple[RankMemory, ...]:
    """Bytes each pipeline rank holds under `schedule` (lowered or not) and `model`."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"predict_memory needs a schedules.Schedule, got {schedule!r}")
    if not isinstance(model, MemoryModel):
        raise TypeError(f"model must be a schedules.MemoryModel, got {model!r}")
    num_stages = schedule.num_stages
    params = _per_stage("params", model.params, num_stages)
    saved = _per_stage("saved", model.saved, num_stages)
    streams = schedule.compute_streams() if schedule.lowered else schedule.streams
    dp, zero = model.data_parallel, model.zero_stage == 1
    result = []
    for rank, stream in enumerate(streams):
        stage_params = sum(params[s] for s in schedule.stages_of(rank))
        grads = stage_params * model.gradient_factor
        peak, count = _activation_peak([(op[0], op[1], op[2]) for op in stream], saved)
        result.append(RankMemory(
            rank=rank, params=stage_params,
            gradients=grads * (2 + 1 / dp) if zero else grads,
            optimizer=stage_params * (model.optimizer_factor + 1) / dp if zero
            else stage_params * model.optimizer_factor,
            activations=peak, peak_in_flight=count))
    return tuple(result)
