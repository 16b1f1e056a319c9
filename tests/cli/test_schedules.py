"""`pipesched simulate` and `pipesched schedule` end to end: the console script once in a
subprocess, the rest in-process through the entry point it calls."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from schedules import Schedule, build_schedule
from tests.support.cli_helpers import REPO, call_cli


@pytest.mark.slow
@pytest.mark.fast  # the one run of the installed console script itself
def test_the_console_script_prints_the_figures() -> None:
    script = Path(sys.executable).with_name("pipesched")
    if not script.exists():
        pytest.skip(f"no {script}: the package is not installed here (pip install -e .)")
    done = subprocess.run([str(script), "simulate", "--schedule", "1f1b", "--stages", "2",
                           "--microbatches", "3", "--json"], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["makespan"] == 12.0


def test_simulate_json_has_the_figures() -> None:
    done = call_cli("simulate", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8",
                   "--backward", "1", "--weight", "0", "--json")
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    assert payload["makespan"] == 22.0
    assert payload["bubble_rate"] == pytest.approx(3 / 11)
    assert payload["idle_fraction"] == pytest.approx(3 / 11)
    assert [r["peak_activations"] for r in payload["ranks"]] == [4, 3, 2, 1]
    assert [r["busy"] for r in payload["ranks"]] == [16.0] * 4


def test_simulate_table_is_readable() -> None:
    done = call_cli("simulate", "--schedule", "interleaved", "--stages", "2", "--microbatches",
                   "4", "--chunks", "2")
    assert done.returncode == 0, done.stderr
    assert "schedule interleaved   p=2  m=4  v=2" in done.stdout
    assert "bubble_rate" in done.stdout and "peak activations" in done.stdout


def test_schedule_prints_streams_that_parse_back() -> None:
    done = call_cli("schedule", "--schedule", "1f1b", "--stages", "3", "--microbatches", "5")
    assert done.returncode == 0, done.stderr
    parsed = Schedule.from_text(done.stdout, num_microbatches=5)
    assert parsed.streams == build_schedule("1f1b", 3, 5).streams


@pytest.mark.parametrize(("args", "message"), [
    (["--schedule", "pipedream", "--stages", "4", "--microbatches", "8"], "invalid choice"),
    (["--schedule", "1f1b", "--stages", "0", "--microbatches", "8"], "--stages: must be >= 1"),
    (["--schedule", "1f1b", "--stages", "4", "--microbatches", "-2"],
     "--microbatches: must be >= 1"),
    (["--schedule", "1f1b", "--stages", "x", "--microbatches", "2"], "expected a whole number"),
    (["--schedule", "gpipe", "--stages", "2", "--microbatches", "2", "--chunks", "3"],
     "takes chunks in 1, got 3"),
    (["--schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--forward", "-1"],
     "finite number >= 0"),
])
def test_bad_values_are_one_line_and_exit_2(args: list[str], message: str) -> None:
    for command in ("simulate", "schedule"):
        if command == "schedule" and "--forward" in args:
            continue
        done = call_cli(command, *args)
        assert done.returncode == 2
        assert message in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "Traceback" not in done.stderr
