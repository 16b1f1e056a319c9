"""The `pipesched partition` subcommand, driven through its own argparse parser."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from partition import CostFileError, InfeasibleMemoryError, PartitionError, UnknownMethodError
from pipeline.cli import partition_cmd

__all__: list[str] = []

COSTS = {
    "layers": [
        {"name": "embed", "forward": 1, "backward": 1, "params": 4000, "activation": 10},
        {"name": "block0", "forward": 2, "backward": 4, "params": 1000, "activation": 10},
        {"name": "block1", "forward": 2, "backward": 4, "params": 1000, "activation": 10},
        {"name": "block2", "forward": 2, "backward": 4, "params": 1000, "activation": 10},
        {"name": "head", "forward": 3, "backward": 6, "params": 4000, "activation": 40},
    ],
    "bandwidth": 100,
}


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pipesched")
    partition_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["partition", *argv])
    return int(args.func(args))


@pytest.fixture
def costs(tmp_path: Path) -> str:
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(COSTS))
    return str(path)


def test_prints_a_table(costs: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["--costs", costs, "--stages", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("balanced partition: 5 layers into 2 stages")
    assert "bottleneck" in out and "embed .. " in out


def test_json_output(costs: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["--costs", costs, "--stages", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["boundaries"][0] == 0 and data["boundaries"][-1] == 5
    assert len(data["boundaries"]) == 4 and len(data["cost"]) == 3
    assert data["bottleneck"] == max(data["cost"])


def test_methods_and_options(costs: str, capsys: pytest.CaptureFixture[str]) -> None:
    run(
        [
            "--costs",
            costs,
            "--stages",
            "2",
            "--method",
            "explicit",
            "--boundaries",
            "0,2,5",
            "--json",
        ]
    )
    assert json.loads(capsys.readouterr().out)["boundaries"] == [0, 2, 5]
    run(["--costs", costs, "--stages", "3", "--method", "type:block", "--json"])
    assert json.loads(capsys.readouterr().out)["method"] == "type"
    run(
        [
            "--costs",
            costs,
            "--stages",
            "2",
            "--speeds",
            "1,2",
            "--schedule",
            "gpipe",
            "--microbatches",
            "4",
            "--memory-cap",
            "1MiB",
            "--bandwidth",
            "1e3",
            "--json",
        ]
    )
    data = json.loads(capsys.readouterr().out)
    assert data["memory_cap"] == 2**20


def test_bad_input_raises_partition_errors(costs: str, tmp_path: Path) -> None:
    with pytest.raises(UnknownMethodError):
        run(["--costs", costs, "--stages", "2", "--method", "fastest"])
    with pytest.raises(CostFileError):
        run(["--costs", str(tmp_path / "nope.json"), "--stages", "2"])
    with pytest.raises(InfeasibleMemoryError, match="smallest cap"):
        run(["--costs", costs, "--stages", "2", "--memory-cap", "100"])
    with pytest.raises(PartitionError, match="not a byte size"):
        run(["--costs", costs, "--stages", "2", "--memory-cap", "lots"])


@pytest.mark.parametrize(
    ("text", "size"),
    [("17179869184", 2**34), ("16GiB", 2**34), ("1.5e9", 1.5e9), ("512MB", 512e6), ("80G", 80e9)],
)
def test_parse_bytes(text: str, size: float) -> None:
    assert partition_cmd.parse_bytes(text) == size


def test_partition_plot_writes_an_image(tmp_path: Path) -> None:
    from tests.support.cli_helpers import run_cli

    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"layers": [{"name": f"l{i}", "forward": 1.0 + i % 3,
                                             "params": 10} for i in range(8)]}))
    out = tmp_path / "stages.png"
    done = run_cli("partition", "--costs", str(costs), "--stages", "3", "--plot", str(out))
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = run_cli("partition", "--costs", str(costs), "--stages", "3", "--plot",
                  str(tmp_path / "missing-dir" / "x.png"))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
