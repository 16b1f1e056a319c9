"""`ProgressReporter`: steps done of a total, time elapsed and an estimate of the rest, for a
Python training loop (by default one line at most each 10 s, from global rank 0 only)."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sized
from dataclasses import dataclass
from typing import TextIO, TypeVar

import torch.distributed as dist

from pipeline.errors import PipelineConfigError

__all__ = ["Progress", "ProgressReporter"]

_Item = TypeVar("_Item")


@dataclass(frozen=True)
class Progress:
    """Where a loop stands after a step: what the reporter hands `on_progress`."""

    done: int
    """Steps done so far."""
    total: int | None
    """Steps the loop will do (None: not known)."""
    elapsed: float
    """Seconds since the reporter was made."""
    remaining: float | None
    """Seconds the rest should take at the pace of the steps after the first (the first
    also learns shapes and warms up); None without a total or before a step is done."""
    what: str = "step"
    """The unit's name, for the line."""
    loss: float | None = None
    """The loss the caller gave with this step, if any."""

    def line(self) -> str:
        """One line, e.g. ``step 30/100 (30%), 12 s elapsed, about 28 s left, loss 0.4123``."""
        count = f"{self.what} {self.done}" if self.total is None else \
            f"{self.what} {self.done}/{self.total} ({100 * self.done // max(1, self.total)}%)"
        parts = [count, f"{_seconds(self.elapsed)} elapsed"]
        if self.remaining is not None and self.done < (self.total or 0):
            parts.append(f"about {_seconds(self.remaining)} left")
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4g}")
        return ", ".join(parts)


def _seconds(value: float) -> str:
    if value < 90:
        return f"{value:.0f} s"
    minutes, seconds = divmod(round(value), 60)
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else \
        f"{minutes} min {seconds:02d} s"


class ProgressReporter:
    """Counts a loop's steps and reports them: ``for step in reporter.track(range(n))`` or
    ``reporter.advance(loss=loss)`` after each step.

    `on_progress(progress)` is called after the first step, at most every `every` seconds
    after that, and after the last one (the default prints `Progress.line` to `stream`,
    stderr). Only the global ranks in `ranks` report (default rank 0; None: every rank; a
    run without a process group is rank 0); the others count silently, so every rank may
    run the same loop. `clock` is the time source (seconds; tests give their own).
    """

    def __init__(self, total: int | None = None, *, what: str = "step",
                 on_progress: Callable[[Progress], None] | None = None, every: float = 10.0,
                 ranks: Collection[int] | None = (0,), stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        problems = []
        if total is not None and (isinstance(total, bool) or not isinstance(total, int)
                                  or total < 0):
            problems.append(f"total must be None or an int >= 0, got {total!r}")
        if isinstance(every, bool) or not isinstance(every, int | float) or \
                not (math.isfinite(every) and every >= 0):
            problems.append(f"every must be a number of seconds >= 0, got {every!r}")
        if on_progress is not None and not callable(on_progress):
            problems.append(f"on_progress must be a callable taking a Progress, got "
                            f"{on_progress!r}")
        if ranks is not None and not (isinstance(ranks, Collection) and all(
                isinstance(rank, int) and not isinstance(rank, bool) for rank in ranks)):
            problems.append(f"ranks must be None (every rank) or a collection of global ranks "
                            f"such as (0,), got {ranks!r}")
        if problems:
            raise PipelineConfigError("ProgressReporter: " + "; ".join(problems))
        self.total = total
        self.what = what
        self._report = on_progress or self._print
        self._every = float(every)
        self._stream = stream
        self._clock = clock
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.reports = ranks is None or rank in ranks
        """Whether this rank reports (else it only counts)."""
        self.done = 0
        self._started = clock()
        self._first_done: float | None = None
        self._first_count = 0
        self._last_report: float | None = None

    def advance(self, steps: int = 1, *, loss: float | None = None) -> Progress:
        """Count `steps` more done; report if it is time to. Returns where the loop stands."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise PipelineConfigError(f"advance(steps=) takes an int >= 1, got {steps!r}")
        now = self._clock()
        self.done += steps
        if self._first_done is None:
            self._first_done, self._first_count = now, steps
        progress = self.progress(now, loss)
        due = self._last_report is None or now - self._last_report >= self._every or \
            self.done == self.total
        if self.reports and due:
            self._last_report = now
            self._report(progress)
        return progress

    def progress(self, now: float | None = None, loss: float | None = None) -> Progress:
        """Where the loop stands at `now` (default: the clock's now)."""
        now = self._clock() if now is None else now
        elapsed = now - self._started
        remaining = None
        if self.total is not None and self._first_done is not None and self.done:
            left = max(0, self.total - self.done)
            after_first = self.done - self._first_count  # the first includes the warm-up
            pace = (now - self._first_done) / after_first if after_first else \
                (self._first_done - self._started) / self._first_count
            remaining = pace * left
        return Progress(self.done, self.total, elapsed, remaining, self.what, loss)

    def track(self, items: Iterable[_Item]) -> Iterator[_Item]:
        """Yield `items`, counting one step when the loop body for each item is done (the
        total, when not given, is ``len(items)`` where it has one)."""
        if self.total is None and isinstance(items, Sized):
            self.total = len(items)
        for item in items:
            yield item
            self.advance()

    def _print(self, progress: Progress) -> None:
        print(f"[pipesched] {progress.line()}", file=self._stream or sys.stderr, flush=True)
