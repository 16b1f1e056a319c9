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

from schedules.analysis.accounting import model_state_bytes, stream_peak
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
    output: PerStage = 0.0
    """Bytes of a stage's output, which the engine keeps as the backward's root besides
    `saved` (the last stage's is not kept: its root is the loss)."""
    free_sent_outputs: bool = True
    """The engine's option of that name: an output sent to another rank is freed right
    after its send (only the newest is held at a rank's peak); one passed to a stage on the
    same rank is kept until its backward."""
    data_parallel: int = 1
    """Replicas dp; under ZeRO-1 each holds 1/dp of the optimizer state."""
    zero_stage: int = 0
    """0: every replica keeps the whole optimizer state. 1: sharded over dp as Megatron's
    distributed optimizer holds it (`schedules.analysis.accounting.model_state_bytes`, fp32:
    the gradients accumulate in one buffer, the optimizer steps a 1/dp shard that is a view
    of the parameters: 8 + 8/dp bytes per parameter with Adam)."""
    optimizer_factor: float = 2.0
    """Optimizer-state bytes per parameter byte (Adam: two moments = 2; SGD: 0)."""
    gradient_factor: float = 1.0
    """Gradient bytes per parameter byte (1: gradients in the parameters' dtype)."""

    def __post_init__(self) -> None:
        if isinstance(self.data_parallel, bool) or not isinstance(self.data_parallel, int) \
                or self.data_parallel < 1:
            raise ScheduleConfigError(f"data_parallel must be an int >= 1, got "
                                      f"{self.data_parallel!r}")
        if not isinstance(self.free_sent_outputs, bool):
            raise ScheduleConfigError(f"free_sent_outputs must be True or False, got "
                                      f"{self.free_sent_outputs!r}")
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


def _activation_peak(stream: Sequence[tuple[Kind, int, int]], saved: Sequence[float],
                     output: Sequence[float], sends: Sequence[bool],
                     free_sent_outputs: bool) -> tuple[float, int]:
    """(peak bytes, microbatches held then) of one rank's compute stream."""
    peak = stream_peak(stream, saved, output, sends=sends, free_sent_outputs=free_sent_outputs)
    return peak.bytes, peak.count


def predict_memory(schedule: Schedule, model: MemoryModel) -> tuple[RankMemory, ...]:
    """Bytes each pipeline rank holds under `schedule` (lowered or not) and `model`."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"predict_memory needs a schedules.Schedule, got {schedule!r}")
    if not isinstance(model, MemoryModel):
        raise TypeError(f"model must be a schedules.MemoryModel, got {model!r}")
    num_stages = schedule.num_stages
    params = _per_stage("params", model.params, num_stages)
    saved = _per_stage("saved", model.saved, num_stages)
    output = [*_per_stage("output", model.output, num_stages)[:-1], 0.0]
    placement = schedule.placement
    sends = [s + 1 < num_stages and placement[s + 1] != placement[s]
             for s in range(num_stages)]
    streams = schedule.compute_streams() if schedule.lowered else schedule.streams
    # per fp32 parameter byte: the accounting's bytes per parameter over 4
    states = model_state_bytes("fp32", zero_stage=model.zero_stage,
                               data_parallel=model.data_parallel,
                               optimizer_factor=model.optimizer_factor)
    result = []
    for rank, stream in enumerate(streams):
        stage_params = sum(params[s] for s in schedule.stages_of(rank))
        peak, count = _activation_peak([(op[0], op[1], op[2]) for op in stream], saved,
                                       output, sends, model.free_sent_outputs)
        result.append(RankMemory(
            rank=rank, params=stage_params,
            gradients=stage_params * model.gradient_factor * states.gradients / 4,
            optimizer=stage_params * states.optimizer / 4,
            activations=peak, peak_in_flight=count))
    return tuple(result)
