"""`pipesched plan` on the command line: table, JSON, plot, errors, no torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.cli import main
from tests.support.cli_helpers import REPO

__all__: list[str] = []

SHAPE = "layers=8,hidden=1024,heads=16,vocab=32000,seq=1024"


def test_table_names_the_pick_as_engine_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", SHAPE, "--cluster", "a100-80g", "--global-batch", "16",
                 "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "pick: pp" in out and "PipelineModule/PipelineEngine: num_stages=" in out
    assert "pipesched train --schedule" in out
    assert len(re.findall(r"^ +\d+ pp\d+ tp", out, flags=re.MULTILINE)) == 3


def test_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "plan.png"
    assert main(["plan", "--model", SHAPE, "--cluster", "h100-80g", "--nodes", "2",
                 "--global-batch", "32", "--json", "--plot", str(plot)]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["devices"] == 16
    assert document["pick"]["config"]["label"] == document["ranked"][0]["config"]["label"]
    assert document["ranked"][0]["why_slower"] == "pick"
    assert document["pick"]["memory"]["total"] <= document["device_memory"]
    assert plot.stat().st_size > 1000


@pytest.mark.parametrize(("argv", "words"), [
    (["--cluster", "tpu"], "unknown cluster 'tpu'"),
    (["--model", "layers=8"], "lacks"),
    (["--schedules", "warp"], "not training schedules"),
    (["--tensor-parallel", "two"], "whole numbers"),
])
def test_bad_input_is_one_line_and_exit_2(argv: list[str], words: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    args = {"--model": SHAPE, "--cluster": "a100-80g", "--global-batch": "16"}
    args.update(dict(zip(argv[::2], argv[1::2])))
    assert main(["plan", *[x for pair in args.items() for x in pair]]) == 2
    err = capsys.readouterr().err
    assert words in err and err.startswith("pipesched plan: error:")


@pytest.mark.slow
def test_plan_with_a_preset_never_imports_torch() -> None:
    code = ("import sys; from pipeline.cli import main; "
            f"main(['plan', '--model', '{SHAPE}', '--cluster', 'a100-80g', "
            "'--global-batch', '8', '--top', '1']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
