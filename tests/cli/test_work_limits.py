"""Sizes that would hang or overflow are refused before any work starts, naming the value
and the fix: timeouts, local ranks, run length, emulated bytes, solver and search work."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

from pipeline import launch
from pipeline.cli import main
from pipeline.cli.options import MAX_SEARCHED_WORK
from pipeline.cli.partition_cmd import _MAX_SOLVER_STEPS, _check_work
from pipeline.errors import PipelineConfigError
from pipeline.limits import (
    MAX_TIMEOUT,
    RANK_BYTES,
    check_local_ranks,
    check_run_seconds,
    check_timeout,
    max_local_ranks,
)
from tests.support.cli_helpers import REPO, call_cli

_COSTS = str(REPO / "benchmarks" / "costs" / "uniform16.json")


def _fn() -> None:
    return None


@pytest.mark.parametrize("seconds", [1e300, 1e12, float("inf"), 0, -1])
def test_a_timeout_beyond_thirty_days_is_refused_not_an_overflow(seconds: float) -> None:
    # regression: `train --timeout 1e300` / `1e12` ended in an OverflowError traceback
    with pytest.raises(PipelineConfigError, match="timeout must be a number of seconds"):
        launch(_fn, 2, timeout=seconds)
    with pytest.raises(PipelineConfigError, match=r"in \(0, 2.592e\+06\]"):
        check_timeout(seconds)


def test_the_longest_timeout_is_one_torch_takes() -> None:
    assert datetime.timedelta(seconds=check_timeout(MAX_TIMEOUT)).days == 30
    with pytest.raises(SystemExit):  # argparse: one line, exit 2
        main(["train", "--timeout", "1e300"])


def test_more_local_ranks_than_memory_holds_are_refused() -> None:
    # regression: launch(fn, 10**6) was accepted and `rehearse --data-parallel 10**12`
    # started building process objects
    limit = max_local_ranks()
    check_local_ranks(limit)
    with pytest.raises(PipelineConfigError, match=f"over the {limit:,} this host"):
        check_local_ranks(limit + 1)
    with pytest.raises(PipelineConfigError, match="world_size 1,000,000 would start"):
        launch(_fn, 10**6)
    assert limit * RANK_BYTES >= 8 * RANK_BYTES


@pytest.mark.parametrize(("seconds", "refused"), [(3600.0, False), (7 * 86400.0, False),
                                                  (7 * 86400.0 + 1, True),
                                                  (float("inf"), True), (float("nan"), True)])
def test_run_length_limit(seconds: float, refused: bool) -> None:
    if refused:
        with pytest.raises(PipelineConfigError, match="lower --steps"):
            check_run_seconds(seconds, "--steps")
    else:
        check_run_seconds(seconds, "--steps")


@pytest.mark.parametrize(("extra", "message"), [
    (["--data-parallel", str(10**12)], "would start 2,000,000,000,000 local processes"),
    (["--time-scale", "1e12"], "the run would take about"),
    (["--time-scale", "1e6"], "the run would take about"),
    (["--steps", str(10**12)], "lower --steps 1,000,000,000,000"),
    (["--bytes-scale", "1e-9"], "bytes once emulated, over this host's"),
    (["--bytes-scale", "1e-308"], "is inf float32 elements"),  # was an OverflowError
])
def test_rehearse_refuses_runs_it_cannot_finish(extra: list[str], message: str, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["rehearse", "--costs", _COSTS, "--schedule", "1f1b", "--stages", "2",
                 "--microbatches", "4", "--out", str(tmp_path), *extra])
    assert code == 2
    assert message in capsys.readouterr().err


def test_simulate_refuses_a_searched_schedule_too_large_to_search(
        capsys: pytest.CaptureFixture[str]) -> None:
    # regression: interleaved-zb at p=64, m=512 ran for over a minute
    assert main(["simulate", "--schedule", "interleaved-zb", "--stages", "64",
                 "--microbatches", "512"]) == 2
    assert "65,536 stage-microbatches, over the limit of" in capsys.readouterr().err
    assert 16 * 512 * 2 <= MAX_SEARCHED_WORK < 64 * 512 * 2


@pytest.mark.parametrize(("layers", "stages", "chain"), [
    (4000, 2000, False), (200_000, 100_000, True), (4000, 63, False), (1_000_000, 128, True)])
def test_partition_refuses_solver_work_over_the_limit(layers: int, stages: int,
                                                      chain: bool) -> None:
    # regression: a 4,000-node DAG into 2,000 stages and a 200k chain into 100,000 stages
    # each ran for over a minute; the oracle is the solvers' stated complexity
    work = stages * layers * (1 if chain else layers)
    if work > _MAX_SOLVER_STEPS:
        with pytest.raises(ValueError, match="solver steps"):
            _check_work(layers, stages, chain)
    else:
        _check_work(layers, stages, chain)


def test_train_refuses_a_run_of_a_trillion_steps(tmp_path: Path) -> None:
    done = call_cli("train", "--steps", str(10**12), "--out", str(tmp_path))
    assert done.returncode == 2, done.stderr
    assert "lower --steps 1,000,000,000,000" in done.stderr and "Traceback" not in done.stderr


def test_partition_refuses_speeds_a_million_times_apart(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    # regression: --speeds 1e-308,1,1,1 printed a stage time of 300 digits
    assert main(["partition", "--costs", _COSTS, "--stages", "4", "--speeds",
                 "1e-308,1,1,1"]) == 2
    assert "the fastest stage is 1e+308 times the slowest" in capsys.readouterr().err
    assert main(["partition", "--costs", _COSTS, "--stages", "4", "--speeds",
                 "1e-6,1,1,1"]) == 0


def test_rehearse_counts_gradients_and_optimizer_state_against_host_memory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # regression: the check counted parameters once (no gradients, no Adam moments): a
    # costs file describing 8 GB of parameters passed and a rank reached 15.6 GB
    import json

    import pipeline.limits

    layers = json.loads(Path(_COSTS).read_text())["layers"]
    param_bytes = sum(layer["params"] for layer in layers)  # fp32 weights, bytes_scale 1
    activation_bytes = 4 * sum(layer["activation"] for layer in layers)  # every mb held
    # oracle, from the definition: fp32 Adam holds weights + gradients + 2 moments = 4x
    model_state = 4 * param_bytes
    memory = 3 * param_bytes  # holds what the old check counted, not the model state
    assert param_bytes + activation_bytes < memory < model_state
    monkeypatch.setattr(pipeline.limits, "host_memory_bytes", lambda: memory)
    code = main(["rehearse", "--costs", _COSTS, "--schedule", "1f1b", "--stages", "2",
                 "--microbatches", "4", "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "over this host's" in err and f"model state {model_state:.3g}" in err
