"""`pipesched plan`'s filters, `--price`, its refusals, the "why slower" decomposition and
the plot (issue 21, defects 1-5)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from pipeline.cli import main
from pipeline.planner import (
    PRESETS,
    PlanError,
    SearchOptions,
    parse_shape,
    plan,
    transformer_profile,
)
from pipeline.planner.report import gap_parts, loss_reason
from pipeline.planner.search import price

__all__: list[str] = []

SHAPE = "layers=8,hidden=1024,heads=16,vocab=32000,seq=1024"
HEADS24 = "layers=24,hidden=2304,heads=24,vocab=51200,seq=2048"


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_tensor_parallel_that_does_not_divide_the_heads_is_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["--model", HEADS24, "--cluster", "a100-80g", "--nodes", "4",
                         "--global-batch", "512", "--tensor-parallel", "16"], capsys)
    assert code == 2
    assert "16 does not divide the model's 24 attention heads" in err


def test_tensor_parallel_that_does_not_divide_the_devices_is_named_as_the_cause(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["--model", SHAPE, "--cluster", "a100-80g", "--nodes", "8",
                         "--global-batch", "512", "--tensor-parallel", "3"], capsys)
    assert code == 2
    assert "tensor-parallel size 3 does not divide the 64 devices" in err
    assert "global batch divisible" not in err


@pytest.fixture(scope="module")
def searched() -> Any:
    model = transformer_profile(parse_shape(SHAPE))
    cluster = replace(PRESETS["a100-80g"], nodes=2)
    return model, cluster, plan(model, cluster, 64, options=SearchOptions(top=40))


def test_why_slower_parts_sum_to_the_net_gap(searched: Any) -> None:
    _, _, result = searched
    pick = result.best
    for prediction in result.predictions[:40]:
        # every breakdown sums to its step, so the parts sum to the net gap
        assert sum(prediction.breakdown.values()) == pytest.approx(prediction.step_seconds)
        gap = prediction.step_seconds - pick.step_seconds
        assert sum(gap_parts(prediction, pick).values()) == pytest.approx(gap, abs=1e-12)
        if prediction is not pick and gap > 0:
            text = loss_reason(prediction, pick)
            assert text.startswith("+"), text  # the net gap leads, not one cause's growth


def test_search_filters_restrict_every_configuration() -> None:
    model = transformer_profile(parse_shape(SHAPE))
    cluster = replace(PRESETS["a100-80g"], nodes=2)
    options = SearchOptions(pipeline_parallel=(2, 4), tensor_parallel=(2,), data_parallel=(4, 2),
                            microbatch_sizes=(2,), zero_stages=(1,), recompute_choices=(True,),
                            top=10_000)
    result = plan(model, cluster, 64, options=options)
    assert result.predictions
    for prediction in result.predictions:
        config = prediction.config
        assert (config.pp in (2, 4) and config.tp == 2 and config.dp in (2, 4)
                and config.microbatch_size == 2 and config.zero_stage == 1
                and config.recompute == "full")
    with pytest.raises(PlanError, match="pipeline-parallel size 3 does not divide"):
        plan(model, cluster, 64, options=SearchOptions(pipeline_parallel=(3,)))


def test_price_gives_the_searched_configurations_own_prediction(searched: Any) -> None:
    model, cluster, result = searched
    for prediction in result.predictions[:5]:
        priced = price(model, cluster, 64, prediction.config)
        assert priced.step_seconds == pytest.approx(prediction.step_seconds)
        assert priced.memory.total == pytest.approx(prediction.memory.total)


def test_price_on_the_command_line_prints_the_breakdown(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(["--model", SHAPE, "--cluster", "a100-80g", "--nodes", "2",
                         "--global-batch", "64", "--price", "pp4,tp1,1f1b,b2"], capsys)
    assert code == 0
    assert "pp4 tp1 dp4 1f1b b2 m8 z0" in out
    for cause in ("compute", "bubble", "dp_comm", "optimizer", "total"):
        assert cause in out
    code, _, err = _run(["--model", SHAPE, "--cluster", "a100-80g", "--global-batch", "64",
                         "--price", "pp4,warp"], capsys)
    assert code == 2 and "item 'warp'" in err


def test_help_points_to_a_section_that_exists(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert "see NOTES" not in out
    assert "(see CLUSTER FILES below)" in out and "\nCLUSTER FILES\n" in out
    assert "\nPRICING ONE CONFIGURATION\n" in out


def test_plot_title_is_not_cut_and_the_axis_spans_the_top(
        searched: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import viz.output
    from pipeline.planner.report import plot_plan

    _, cluster, result = searched
    figures = []

    def keep(figure: Any, path: Any) -> Path:
        figures.append(figure)
        return Path(path)

    monkeypatch.setattr(viz.output, "save_figure", keep)
    plot_plan(result, cluster, tmp_path / "plan.png", top=5)
    figure = figures[0]
    axes = figure.axes[0]
    renderer = figure.canvas.get_renderer()
    title = axes.title.get_window_extent(renderer)
    page = figure.bbox
    assert title.x0 >= page.x0 and title.x1 <= page.x1  # the whole title is on the page
    low, high = axes.get_ylim()
    top = [p.step_seconds for p in result.predictions[:5]]
    assert low <= min(top) and max(top) <= high
    assert high < result.predictions[-1].step_seconds  # not stretched to the slowest
    numbers = {text.get_text() for text in axes.texts}
    assert {"1", "2", "3", "4", "5"} <= numbers  # every top configuration labelled


def test_the_lower_bound_never_exceeds_a_simulated_step() -> None:
    # the bound prunes the search at scale (its drain term included): it must hold for
    # every schedule the search prices, or the top K and the Pareto front lose members
    from pipeline.planner.bounds import SearchBounds
    from pipeline.planner.predict import PlanContext

    model = transformer_profile(parse_shape("layers=8,hidden=512,heads=8,vocab=8000,seq=256"))
    cluster = replace(PRESETS["a100-80g"], nodes=1)
    result = plan(model, cluster, 32, options=SearchOptions(top=100_000))
    assert result.skipped_by_bound == 0 and len(result.predictions) > 100
    bounds = SearchBounds(PlanContext(model, cluster, 32, cluster.precision))
    for prediction in result.predictions:
        bound = bounds.lower_bound(prediction.config)
        assert bound <= prediction.step_seconds * (1 + 1e-9), prediction.config.label()


def test_the_search_time_printed_is_cpu_not_wall(monkeypatch: pytest.MonkeyPatch) -> None:
    # issue 48: a loaded host printed 96.8 s (wall) for a 2.6 s (CPU) search
    import pipeline.planner.search as search_module
    from pipeline.planner.search import format_counts

    clocks = {"wall": 0.0, "cpu": 0.0}

    def tick(name: str, by: float) -> Any:
        def now() -> float:
            clocks[name] += by
            return clocks[name]
        return now

    monkeypatch.setattr(search_module.time, "perf_counter", tick("wall", 50.0))
    monkeypatch.setattr(search_module.time, "process_time", tick("cpu", 0.5))
    model = transformer_profile(parse_shape(SHAPE))
    result = plan(model, PRESETS["a100-80g"], 64, options=SearchOptions(top=2))
    assert result.seconds == pytest.approx(0.5) and result.wall_seconds == pytest.approx(50.0)
    assert format_counts(result).endswith("; 0.50 s of CPU (50.00 s wall)")


def test_a_leaner_runner_up_within_one_percent_is_named(searched: Any) -> None:
    # issue 46: the plot starred a pick needing 71 GiB over a runner-up 0.2 % slower at 44.5
    from pipeline.planner.report import (
        LEANER_SAVING,
        LEANER_WITHIN,
        leaner_alternative,
        leaner_line,
    )

    _, _, result = searched
    pick, top = result.best, result.predictions[:10]
    # the oracle, from the definition: the leanest of the top within 1 % and 10 % leaner
    close = [p for p in top if p is not pick
             and p.step_seconds <= pick.step_seconds * (1 + LEANER_WITHIN)
             and p.memory.total <= pick.memory.total * (1 - LEANER_SAVING)]
    found = leaner_alternative(result)
    if not close:
        assert found is None and leaner_line(result) is None
        # plant one: a runner-up as fast as the pick at half its memory
        lean = replace(top[1], step_seconds=pick.step_seconds,
                       memory=replace(top[1].memory, activations=0.0, parameters=0.0,
                                      gradients=0.0, optimizer=0.0))
        result = replace(result, predictions=[pick, lean, *top[2:]])
        close, found = [lean], leaner_alternative(result)
    assert found is not None
    row, leaner = found
    assert leaner is min(close, key=lambda p: p.memory.total)
    assert result.predictions[row - 1] is leaner
    assert f"leaner: #{row} " in (leaner_line(result) or "")
