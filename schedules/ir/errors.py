"""Typed errors raised by schedule generators, the validator and the simulator."""

from __future__ import annotations

__all__ = ["ScheduleConfigError", "ScheduleError", "ScheduleParseError", "ScheduleValidationError"]


class ScheduleError(ValueError):
    """Base class of every error the `schedules` package raises."""


class ScheduleConfigError(ScheduleError):
    """A generator or cost model was given values it cannot build a schedule from."""


class ScheduleParseError(ScheduleError):
    """Text that should hold instructions does not parse."""


class ScheduleValidationError(ScheduleError):
    """A schedule breaks an invariant; `rank`/`step` locate the first violation.

    The message ends with the rank × step grid around the failing step, which is
    marked with brackets, so a broken schedule can be read straight from the error.
    """

    def __init__(self, message: str, *, rank: int | None = None, step: int | None = None,
                 grid: str = "") -> None:
        self.rank = rank
        self.step = step
        self.grid = grid
        super().__init__(f"{message}\n{grid}" if grid else message)
