"""The new schedules from the command line: names, --memory-limit, constraint errors."""

from __future__ import annotations

import json

import pytest

from schedules import SCHEDULES, Schedule, build_schedule
from tests.support.cli_helpers import call_cli


def test_zb_v_simulates_with_no_bubble_at_equal_costs() -> None:
    done = call_cli("simulate", "--schedule", "zb-v", "--stages", "4", "--microbatches", "8",
                   "--json")
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    assert payload["chunks"] == 2 and payload["bubble_rate"] == 0.0
    assert [r["peak_activations"] for r in payload["ranks"]] == [8] * 4  # 4 stage activations


def test_zb_auto_takes_a_memory_limit_and_keeps_it() -> None:
    done = call_cli("simulate", "--schedule", "zb-auto", "--stages", "4", "--microbatches", "12",
                   "--weight", "0.5", "--comm", "0.05", "--memory-limit", "5", "--json")
    assert done.returncode == 0, done.stderr
    assert max(r["peak_activations"] for r in json.loads(done.stdout)["ranks"]) <= 5
    printed = call_cli("schedule", "--schedule", "zb-auto", "--stages", "3", "--microbatches",
                      "6", "--memory-limit", "3")
    assert printed.returncode == 0, printed.stderr
    parsed = Schedule.from_text(printed.stdout, num_microbatches=6)
    assert parsed.streams == build_schedule("zb-auto", 3, 6, memory_limit=3).streams


@pytest.mark.parametrize(("args", "message"), [
    (["--schedule", "dualpipev", "--stages", "4", "--microbatches", "6"],
     "dualpipev needs num_microbatches >= 2 × num_ranks = 8, got 6"),
    (["--schedule", "zb-h2", "--stages", "4", "--microbatches", "6", "--memory-limit", "4"],
     "takes no memory limit"),
    (["--schedule", "zb-v", "--stages", "4", "--microbatches", "6", "--chunks", "3"],
     "takes chunks in 2, got 3"),
    (["--schedule", "zb-auto", "--stages", "4", "--microbatches", "6", "--memory-limit", "0"],
     "--memory-limit: must be >= 1"),
])
def test_constraint_errors_are_one_line_and_exit_2(args: list[str], message: str) -> None:
    done = call_cli("simulate", *args)
    assert done.returncode == 2
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_every_new_name_is_registered() -> None:
    assert {"zb-h1", "zb-h2", "zb-v", "dualpipev", "looped-bfs", "zb-auto"} <= set(SCHEDULES)
