"""`pipesched simulate --plot/--trace/--memory-plot` and `pipesched compare`, end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.viz_helpers import png_size, svg_size_points

ROOT = Path(__file__).resolve().parents[2]


def pipesched(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_simulate_writes_plot_memory_plot_and_trace(tmp_path: Path) -> None:
    done = pipesched("simulate", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8",
                     "--json", "--plot", tmp_path / "t.png", "--memory-plot",
                     tmp_path / "m.svg", "--trace", tmp_path / "t.json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["bubble_rate"] == pytest.approx(9 / 33)  # stdout stays JSON
    assert png_size(tmp_path / "t.png")[0] == 1300
    assert svg_size_points(tmp_path / "m.svg")[0] == pytest.approx(13 * 72)
    trace = json.loads((tmp_path / "t.json").read_text())
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == 4 * 8 * 2
    assert "wrote" in done.stderr


def test_compare_prints_the_table_and_plots(tmp_path: Path) -> None:
    done = pipesched("compare", "--schedules", "gpipe,1f1b,interleaved", "--stages", "4",
                     "--microbatches", "8", "--chunks", "2", "--plot", tmp_path / "c.svg")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    header = next(n for n, line in enumerate(lines) if line.startswith("schedule"))
    table = [line.split() for line in lines[header + 1:header + 4]]
    assert [row[0] for row in table] == ["gpipe", "1f1b", "interleaved"]
    assert table[1][2:4] == ["33", "units"] and table[1][4] == "27.3%"
    assert table[2][1] == "2"  # --chunks went to the interleaved schedule only
    assert svg_size_points(tmp_path / "c.svg")[0] == pytest.approx(13 * 72)


@pytest.mark.parametrize(("args", "message"), [
    (("compare", "--schedules", "gpipe,zigzag"), "unknown schedule 'zigzag'; choose from"),
    (("compare", "--schedules", "gpipe,1f1b", "--chunks", "2"), "--chunks 2 applies to none"),
    (("simulate", "--schedule", "1f1b", "--chunks", "2"), "takes chunks in 1"),
    (("simulate", "--schedule", "1f1b", "--plot", "/nonexistent-dir/t.png"),
     "does not exist; create it first"),
    (("compare", "--plot", "out.pdf"), "'.pdf' is not a format we write"),
])
def test_errors_at_the_edge_are_one_line_and_exit_2(args: tuple[str, ...],
                                                    message: str) -> None:
    done = pipesched(*args, "--stages", "2", "--microbatches", "2")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert done.stdout == ""
