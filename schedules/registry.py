"""Schedules by name: the one table the CLI, the engine and the benchmarks choose from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from schedules.errors import ScheduleConfigError
from schedules.generators import forward_only, gpipe, interleaved_1f1b, one_f_one_b
from schedules.lowering import add_optimizer_step, lower
from schedules.schedule import Schedule, check_count, gc_paused

__all__ = ["SCHEDULES", "ScheduleSpec", "build_schedule", "generate_schedule"]


@dataclass(frozen=True)
class ScheduleSpec:
    """How to make one named schedule."""

    make: Callable[[int, int, int], Schedule]
    """(p, m, v) -> compute-only schedule."""
    chunks: tuple[int, int | None]
    """Allowed chunks per rank: (min, max); max None means unbounded."""
    default_chunks: int
    summary: str


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(lambda p, m, v: gpipe(p, m), (1, 1), 1,
                          "all forwards, then all backwards; m activations per rank"),
    "1f1b": ScheduleSpec(lambda p, m, v: one_f_one_b(p, m), (1, 1), 1,
                         "PipeDream-Flush: warm-up, one-forward-one-backward, cool-down"),
    "interleaved": ScheduleSpec(interleaved_1f1b, (1, None), 2,
                                "Megatron interleaved 1F1B, v chunks per rank in a loop"),
    "forward-only": ScheduleSpec(forward_only, (1, None), 1, "inference: forwards only"),
}


@gc_paused
def generate_schedule(name: str, num_ranks: int, num_microbatches: int,
                      chunks: int | None = None) -> Schedule:
    """The compute-only schedule called `name` (see `SCHEDULES`) for p, m and v."""
    spec = SCHEDULES.get(name)
    if spec is None:
        raise ScheduleConfigError(
            f"unknown schedule {name!r}; choose one of: {', '.join(SCHEDULES)}")
    check_count("num_ranks (pipeline stages P)", num_ranks)
    check_count("num_microbatches", num_microbatches)
    v = spec.default_chunks if chunks is None else check_count("chunks", chunks)
    low, high = spec.chunks
    if v < low or (high is not None and v > high):
        allowed = f"{low}" if low == high else f"{low}..{high if high is not None else ''}"
        raise ScheduleConfigError(
            f"schedule {name!r} takes chunks in {allowed}, got {v}"
            + ("; use 'interleaved' for several chunks per rank" if high == 1 else ""))
    return spec.make(num_ranks, num_microbatches, v)


@gc_paused
def build_schedule(name: str, num_ranks: int, num_microbatches: int,
                   chunks: int | None = None) -> Schedule:
    """`generate_schedule`, then the shared passes: communication, then reduce-grad and step."""
    return add_optimizer_step(lower(generate_schedule(name, num_ranks, num_microbatches, chunks)))
