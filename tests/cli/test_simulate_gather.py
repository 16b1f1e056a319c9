"""`pipesched simulate --gather-time`: ZeRO-1's parameter gather in the figures and the plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.cli import main
from schedules import CostModel, ParamGather, build_schedule, simulate
from viz import bar_extents, bars_labelled, plot_timeline
from viz.gantt import GATHER_LABEL

__all__: list[str] = []

ARGS = ["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "2",
        "--zero-stage", "1", "--gather-time", "2", "--reduce-buckets", "2"]


def _json(capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, object]:
    assert main([*ARGS, *extra, "--json"]) == 0
    return dict(json.loads(capsys.readouterr().out))


def test_exposed_gather_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    # makespan 9; blocking: each rank's G = 2 after its compute (rank 0 ends at 9)
    payload = _json(capsys)
    assert payload["step"] == pytest.approx(11.0)
    assert [r["exposed_gather"] for r in payload["ranks"]] == pytest.approx(  # type: ignore
        [2.0, 2.0])
    assert all("exposed_reduction" not in r for r in payload["ranks"])  # type: ignore
    # overlapped: buckets at 1 and 2, rank 0's first F from max(1, 2 - 1/2): shifted 1.5
    payload = _json(capsys, "--overlap-param-gather")
    assert payload["step"] == pytest.approx(10.5)
    assert [r["exposed_gather"] for r in payload["ranks"]] == pytest.approx(  # type: ignore
        [1.5, 0.0])
    # one layer per stage waits for both buckets
    payload = _json(capsys, "--overlap-param-gather", "--gather-layers", "1")
    assert payload["step"] == pytest.approx(11.0)


def test_table_has_the_gather_column(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS, "--overlap-param-gather"]) == 0
    out = capsys.readouterr().out
    assert "step 10.500 (with the parameter gather)" in out and "exposed gather" in out


def test_gather_without_zero1_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS, "--zero-stage", "0"]) != 0
    assert "add --zero-stage 1" in capsys.readouterr().err


def test_overlap_without_a_gather_time_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "2",
                 "--overlap-param-gather"]) != 0
    assert "give --gather-time too" in capsys.readouterr().err


def test_plot_draws_each_gather_bucket_on_its_rank(tmp_path: Path) -> None:
    costs = CostModel(gather=ParamGather(time=3.0, buckets=3, overlap=True))
    timeline = simulate(build_schedule("1f1b", 2, 2), costs)
    figure = plot_timeline(timeline, tmp_path / "gather.png")
    (bars,) = bars_labelled(figure.axes[0], GATHER_LABEL)
    left, width, centre = bar_extents(bars)
    assert len(left) == 6 and sum(width) == pytest.approx(6.0)
    assert sorted(round(y) for y in centre) == [0, 0, 0, 1, 1, 1]
    assert min(left) == pytest.approx(0.0)  # from the step's start
    assert "step with gather" in figure.axes[0].get_title(loc="left")


def test_plan_prices_the_overlapped_gather(capsys: pytest.CaptureFixture[str]) -> None:
    def step(*extra: str) -> float:
        assert main(["plan", "--model", "layers=8,hidden=1024,heads=16,vocab=32000,seq=1024",
                     "--cluster", "a100-80g", "--nodes", "2", "--global-batch", "64",
                     "--price", "pp2,tp1,1f1b,b2,z1", "--json", *extra]) == 0
        return float(json.loads(capsys.readouterr().out)["step_seconds"])

    assert step("--overlap-param-gather") < step()
