"""`pipesched simulate --reduce-time`: the gradient reduction in the figures and the plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.cli import main
from schedules import CostModel, GradReduction, build_schedule, simulate
from viz import bar_extents, bars_labelled, plot_timeline
from viz.gantt import REDUCE_LABEL

__all__: list[str] = []

ARGS = ["simulate", "--schedule", "1f1b", "--stages", "4", "--microbatches", "4"]


def _json(capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, object]:
    assert main([*ARGS, *extra, "--json"]) == 0
    return dict(json.loads(capsys.readouterr().out))


def test_without_a_reduction_the_output_is_as_before(capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    payload = _json(capsys)
    assert "step" not in payload
    assert all("exposed_reduction" not in rank for rank in payload["ranks"])  # type: ignore


def test_exposed_reduction_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    # rank r's last B is [19 - 2r, 21 - 2r]; R = 4 in 4 buckets of 1: final at e - 1.5,
    # e - 1, e - 0.5, e -> the last ends at e + 2.5 (overlap); at e + 4 without
    payload = _json(capsys, "--reduce-time", "4", "--reduce-buckets", "4")
    assert payload["makespan"] == 21.0 and payload["step"] == pytest.approx(23.5)
    assert [r["exposed_reduction"] for r in payload["ranks"]] == pytest.approx(  # type: ignore
        [2.5] * 4)
    payload = _json(capsys, "--reduce-time", "4", "--reduce-buckets", "4",
                    "--no-overlap-grad-reduce")
    assert payload["step"] == pytest.approx(25.0)
    # ZeRO-1 over 2: each bucket is split 2 ways, so buckets are final when plain ones are
    payload = _json(capsys, "--reduce-time", "4", "--reduce-buckets", "4",
                    "--data-parallel", "2", "--zero-stage", "1")
    assert payload["step"] == pytest.approx(23.5)


def test_time_from_bytes_and_bandwidth(capsys: pytest.CaptureFixture[str]) -> None:
    # a ring over d = 2: 2(d - 1)/d · 800 / 100 = 8, in one bucket (800 B < 25 MiB): exposed
    payload = _json(capsys, "--params-bytes", "800", "--reduce-bandwidth", "100",
                    "--data-parallel", "2")
    assert payload["step"] == pytest.approx(29.0)


@pytest.mark.parametrize(("extra", "message"), [
    (["--reduce-time", "1", "--reduce-bandwidth", "2"], "not both"),
    (["--reduce-bandwidth", "2"], "give --params-bytes"),
])
def test_contradictions_are_refused(capsys: pytest.CaptureFixture[str], extra: list[str],
                                    message: str) -> None:
    assert main([*ARGS, *extra]) != 0
    assert message in capsys.readouterr().err


def test_plot_draws_each_bucket_on_its_rank(tmp_path: Path) -> None:
    costs = CostModel(reduction=GradReduction(time=3.0, buckets=3))
    timeline = simulate(build_schedule("1f1b", 2, 2), costs)
    figure = plot_timeline(timeline, tmp_path / "reduce.png")
    (bars,) = bars_labelled(figure.axes[0], REDUCE_LABEL)
    left, width, centre = bar_extents(bars)
    assert len(left) == 6 and sum(width) == pytest.approx(6.0)
    assert sorted(round(y) for y in centre) == [0, 0, 0, 1, 1, 1]  # on each rank's row
    assert "step with reduction" in figure.axes[0].get_title(loc="left")
