"""Up-front checks: the schedule that fits the module, validated, and agreement across ranks."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

from pipeline.errors import PipelineConfigError
from pipeline.model.module import PipelineModule
from schedules import (
    Kind,
    Schedule,
    ScheduleError,
    add_optimizer_step,
    build_schedule,
    lower,
    validate,
)

__all__ = ["check_agreement", "fingerprint", "forward_schedule", "resolve_schedule"]


def resolve_schedule(schedule: str | Schedule, module: PipelineModule,
                     num_microbatches: int | None) -> Schedule:
    """The lowered, validated training schedule for `module`; refuses one that does not fit."""
    p, v = module.num_stages, module.chunks
    if isinstance(schedule, str):
        if num_microbatches is None:
            raise PipelineConfigError(f"schedule {schedule!r} needs num_microbatches=")
        try:  # the registry checks the name and the chunks per rank
            built = build_schedule(schedule, p, num_microbatches, v)
        except ScheduleError as error:
            raise PipelineConfigError(
                f"cannot build schedule {schedule!r} for the module (num_stages × chunks = "
                f"{p} × {v}): {error}; change the schedule or PipelineModule(..., chunks=)"
            ) from error
    elif isinstance(schedule, Schedule):
        try:
            if not schedule.lowered:
                validate(schedule)  # names a skipped microbatch before lowering trips on it
            built = schedule if schedule.lowered else lower(schedule)
            if built.has_backward and not any(op.kind is Kind.STEP for stream in built.streams
                                              for op in stream):
                built = add_optimizer_step(built)
        except ScheduleError as error:
            raise PipelineConfigError(f"schedule {schedule.name!r} is refused: {error}") \
                from error
        if num_microbatches is not None and num_microbatches != built.num_microbatches:
            raise PipelineConfigError(
                f"num_microbatches={num_microbatches} but schedule {built.name!r} was made "
                f"for {built.num_microbatches}; drop the argument or rebuild the schedule")
    else:
        raise TypeError(f"schedule must be a name or a schedules.Schedule, got {schedule!r}")
    _check_fit(built, module)
    try:
        validate(built)
    except ScheduleError as error:
        raise PipelineConfigError(f"schedule {built.name!r} is refused: {error}") from error
    return built


def _check_fit(schedule: Schedule, module: PipelineModule) -> None:
    problems = []
    if schedule.num_ranks != module.num_stages:
        problems.append(f"it runs on {schedule.num_ranks} pipeline ranks but the module has "
                        f"num_stages={module.num_stages}")
    if schedule.num_stages != module.total_stages:
        problems.append(f"it places {schedule.num_stages} stages ({schedule.chunks} per rank) "
                        f"but the module was cut into num_stages × chunks = {module.num_stages} "
                        f"× {module.chunks} = {module.total_stages}; build the module with "
                        f"chunks={max(1, schedule.num_stages // max(1, schedule.num_ranks))}")
    if problems:
        raise PipelineConfigError(f"schedule {schedule.name!r} does not fit the module: "
                                  + "; ".join(problems))


def forward_schedule(schedule: Schedule) -> Schedule:
    """The inference schedule with the same placement: each rank's forwards in the training
    order (dropping backwards never adds a wait, so the order still runs), lowered."""
    streams = tuple(tuple(op for op in stream if op.kind is Kind.F)
                    for stream in schedule.compute_streams())
    return lower(Schedule(f"{schedule.name}-forward", schedule.num_microbatches,
                          schedule.placement, streams))


def _digest(text: str) -> int:
    return zlib.crc32(text.encode())


def fingerprint(module: PipelineModule, schedule: Schedule, world_size: int,
                extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """What every rank must agree on before the first step."""
    return {
        "world size": world_size, "num_stages": module.num_stages, "chunks": module.chunks,
        "layers": module.num_layers, "stage boundaries": module.boundaries,
        "schedule": schedule.name, "num_microbatches": schedule.num_microbatches,
        "placement": schedule.placement, "streams (crc32)": _digest(schedule.format()),
        "loss_fn": module.loss_fn is not None, **(extra or {}),
    }


def check_agreement(prints: Sequence[dict[str, Any]], ranks: Sequence[int]) -> None:
    """Raise `PipelineConfigError` naming every field on which some rank differs from the first."""
    reference = prints[0]
    problems = []
    for rank, values in zip(ranks, prints):
        for key in sorted(set(reference) | set(values)):
            if values.get(key) != reference.get(key):
                problems.append(f"rank {rank} has {key}={values.get(key)!r} where rank "
                                f"{ranks[0]} has {reference.get(key)!r}")
    if problems:
        shown = problems[:12] + ([f"... and {len(problems) - 12} more"] if len(problems) > 12
                                 else [])
        raise PipelineConfigError("ranks disagree on the pipeline configuration; build the "
                                  "same PipelineModule and PipelineEngine arguments on every "
                                  "rank:\n  " + "\n  ".join(shown))
