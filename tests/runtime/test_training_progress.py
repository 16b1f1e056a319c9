"""`ProgressReporter`: counts, the estimate (checked against its definition on a scripted
clock, never wall time), when it reports, and which ranks do."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from pipeline import Progress, ProgressReporter
from pipeline.errors import PipelineConfigError
from pipeline.runtime import training_progress


class ScriptedClock:
    """A clock that moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


STEP_SECONDS = [9.0, 2.0, 3.0, 1.0, 2.0, 4.0]  # the first step warms up


def _run(every: float) -> list[Progress]:
    """The reported `Progress` values of a loop whose steps take STEP_SECONDS."""
    clock, reported = ScriptedClock(), []
    reporter = ProgressReporter(on_progress=reported.append, every=every, clock=clock)
    for seconds in reporter.track(STEP_SECONDS):
        clock.now += seconds
    return reported


def test_the_estimate_is_the_pace_after_the_first_step_times_the_steps_left() -> None:
    reported, total = _run(every=0.0), len(STEP_SECONDS)
    assert [p.done for p in reported] == list(range(1, total + 1))
    for progress in reported:  # the definition, step by step
        done = progress.done
        assert progress.total == total
        assert progress.elapsed == pytest.approx(sum(STEP_SECONDS[:done]))
        after_first = STEP_SECONDS[1:done]
        pace = sum(after_first) / len(after_first) if after_first else STEP_SECONDS[0]
        assert progress.remaining == pytest.approx(pace * (total - done))


def test_it_reports_the_first_step_then_every_interval_and_the_last() -> None:
    reported = _run(every=5.0)
    # steps end at 9, 11, 14, 15, 17, 21 s: reports at 9 (first), 14 (>= 5 s after 9),
    # 21 (last; also >= 5 s after 14)
    assert [p.done for p in reported] == [1, 3, 6]
    assert reported[-1].remaining == 0.0


def test_the_line_says_count_elapsed_estimate_and_loss() -> None:
    clock, stream = ScriptedClock(), io.StringIO()
    reporter = ProgressReporter(total=100, every=0.0, clock=clock, stream=stream)
    clock.now += 4.0
    reporter.advance(loss=2.5)
    for _ in range(29):
        clock.now += 2.0
        reporter.advance(loss=0.41234)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "[pipesched] step 1/100 (1%), 4 s elapsed, about 6 min 36 s left, " \
                       "loss 2.5"
    assert lines[-1] == "[pipesched] step 30/100 (30%), 62 s elapsed, about 2 min 20 s " \
                        "left, loss 0.4123"


def test_only_rank_0_reports_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    def on_rank(rank: int) -> None:
        monkeypatch.setattr(training_progress, "dist", SimpleNamespace(
            is_available=lambda: True, is_initialized=lambda: True, get_rank=lambda: rank))

    for rank, ranks, reports in ((0, (0,), True), (1, (0,), False), (1, None, True),
                                 (3, (1, 3), True)):
        on_rank(rank)
        reported: list[Progress] = []
        reporter = ProgressReporter(2, on_progress=reported.append, ranks=ranks)
        reporter.advance()
        assert reporter.done == 1 and reporter.reports is reports
        assert bool(reported) is reports


def test_unknown_total_counts_without_an_estimate() -> None:
    reporter = ProgressReporter(on_progress=lambda progress: None)
    progress = reporter.advance(3)
    assert (progress.done, progress.total, progress.remaining) == (3, None, None)
    assert progress.line().startswith("step 3, ")


@pytest.mark.parametrize("options, says", [
    ({"total": -1}, "total must be None or an int >= 0, got -1"),
    ({"every": float("nan")}, "every must be a number of seconds >= 0"),
    ({"on_progress": "print"}, "on_progress must be a callable"),
    ({"ranks": 0}, r"ranks must be None \(every rank\) or a collection"),
])
def test_bad_options_are_refused(options: dict[str, object], says: str) -> None:
    with pytest.raises(PipelineConfigError, match=says):
        ProgressReporter(**options)  # type: ignore[arg-type]


def test_advance_by_nothing_is_refused() -> None:
    with pytest.raises(PipelineConfigError, match="an int >= 1, got 0"):
        ProgressReporter(on_progress=lambda progress: None).advance(0)
