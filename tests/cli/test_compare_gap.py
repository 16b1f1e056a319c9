"""`pipesched compare --optimality-gap`: each heuristic against the proven optimum."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.support.cli_helpers import call_cli

# the `slow` ones solve larger problems to optimality (seconds each)
needs_solver = pytest.mark.skipif(importlib.util.find_spec("ortools") is None,
                                  reason="the optimality gap needs the 'solver' extra")


@needs_solver
@pytest.mark.slow
def test_the_gap_column_is_zero_for_an_optimal_schedule_and_positive_for_1f1b() -> None:
    done = call_cli("compare", "--stages", "3", "--microbatches", "4", "--schedules",
                   "1f1b,zb-h2", "--optimality-gap", "20")
    assert done.returncode == 0, done.stderr
    header, *rows = [line for line in done.stdout.splitlines()[2:] if line.strip()]
    assert header.endswith("optimality gap")
    gaps = {row.split()[0]: row.split()[-1] for row in rows}
    assert gaps["zb-h2"] == "0.0%"  # zero bubble at unit costs: nothing to gain
    assert gaps["1f1b"].endswith("%") and float(gaps["1f1b"].rstrip("%")) > 0
    # each solve (up to --optimality-gap seconds) is announced with what is left at most
    assert "optimality gap 1/2 (1f1b), at most 40 s left" in done.stderr
    assert "optimality gap 2/2 (zb-h2), at most 20 s left" in done.stderr


@needs_solver
def test_json_carries_the_optimum() -> None:
    done = call_cli("compare", "--stages", "2", "--microbatches", "3", "--schedules", "zb-auto",
                   "--optimality-gap", "20", "--json")
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout)["schedules"][0]
    assert row["optimum"]["proven"] and row["optimum"]["makespan"] <= row["makespan"]


def test_too_large_a_problem_is_one_line_naming_the_limits() -> None:
    done = call_cli("compare", "--stages", "9", "--microbatches", "4", "--optimality-gap")
    assert done.returncode == 2
    assert "--stages <= 8 and --microbatches <= 16" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_overlap_fraction_speeds_up_only_the_overlapped_dualpipev() -> None:
    done = call_cli("compare", "--stages", "4", "--microbatches", "8", "--schedules",
                   "dualpipev,dualpipev-overlap", "--overlap", "0.7", "--json")
    assert done.returncode == 0, done.stderr
    makespans = {row["schedule"]: row["makespan"]
                 for row in json.loads(done.stdout)["schedules"]}
    assert makespans["dualpipev"] == pytest.approx(25.5)  # chunks cost 1/2: 51 / 2
    assert makespans["dualpipev-overlap"] == pytest.approx(22.5)


@needs_solver
@pytest.mark.slow
def test_the_optimum_is_never_above_a_listed_schedule() -> None:
    # v-min holds less than any heuristic the solver would start from: its own order is
    # the start, so the optimum at its memory can only be faster (regression: 0%..44%).
    done = call_cli("compare", "--stages", "3", "--microbatches", "6", "--schedules",
                   "v-min,v-half,zb-v,1f1b", "--optimality-gap", "10", "--json")
    assert done.returncode == 0, done.stderr
    for row in json.loads(done.stdout)["schedules"]:
        assert row["optimum"]["makespan"] <= row["makespan"] + 1e-9, row["schedule"]
        assert row["optimum"]["bound"] <= row["optimum"]["makespan"] + 1e-9
