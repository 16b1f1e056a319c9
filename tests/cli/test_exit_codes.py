"""Every `pipesched` failure is one line with a documented exit code: invalid input 2, a
launched job's failure 3 (the full report in the output folder), Ctrl-C 130; a bug keeps
its traceback instead of passing for invalid input."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pipeline.cli as cli
from pipeline.cli import (
    EXIT_CODES,
    EXIT_INPUT,
    EXIT_INTERRUPTED,
    EXIT_RUN_FAILED,
    main,
    partition_cmd,
)
from pipeline.supervision.faults import FaultPoints
from tests.support.cli_helpers import REPO, run_cli

_FAILING_MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn

from pipeline import LayerSpec
from pipeline.demo.user_model import ModelRecipe


class FailsOnRanks(nn.Module):
    """Fine while the CLI profiles it in one process; raises on the launched ranks."""

    def forward(self, x):
        if torch.distributed.is_initialized():
            raise ValueError("planted failure on the last stage")
        return x


def batch(step, size):
    x = torch.randn(size, 6, generator=torch.Generator().manual_seed(step))
    return x, x.sum(dim=1, keepdim=True)


def build():
    return ModelRecipe(layers=[LayerSpec(nn.Linear, 6, 6), torch.tanh,
                               LayerSpec(nn.Linear, 6, 1), LayerSpec(FailsOnRanks)],
                       loss_fn=F.mse_loss, batch=batch)
'''


def test_exit_codes_are_documented_in_the_help() -> None:
    text = cli.build_parser().format_help()
    for code in (EXIT_INPUT, EXIT_RUN_FAILED, EXIT_INTERRUPTED):
        assert f"{code} {EXIT_CODES[code]}" in " ".join(text.split())


def _replace_partition(monkeypatch: pytest.MonkeyPatch, body: object) -> None:
    def run(args: argparse.Namespace) -> int:
        return body()  # type: ignore[operator, no-any-return]
    monkeypatch.setattr(partition_cmd, "run", run)


def test_an_internal_type_error_is_not_passed_off_as_invalid_input(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # regression: `except (ValueError, TypeError, OSError)` turned any bug into "exit 2"
    _replace_partition(monkeypatch, lambda: len(None))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="NoneType"):
        main(["partition", "--costs", "1,2", "--stages", "2"])


def test_our_own_type_refusal_is_invalid_input(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    _replace_partition(monkeypatch, lambda: FaultPoints().arm("checkpoint.file", 5))
    assert main(["partition", "--costs", "1,2", "--stages", "2"]) == EXIT_INPUT
    assert capsys.readouterr().err == ("pipesched partition: error: action must be callable "
                                       "(e.g. kill_self), got 5\n")


def test_ctrl_c_is_one_line(monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted() -> int:
        raise KeyboardInterrupt
    _replace_partition(monkeypatch, interrupted)
    assert main(["partition", "--costs", "1,2", "--stages", "2"]) == EXIT_INTERRUPTED
    assert capsys.readouterr().err == "pipesched partition: interrupted\n"


@pytest.mark.multiprocess
def test_train_failure_after_launch_is_one_line_naming_the_rank(tmp_path: Path) -> None:
    # regression: RankFailedError escaped `pipesched train` as a traceback with exit 1
    model = tmp_path / "failing_model.py"
    model.write_text(_FAILING_MODEL)
    out = tmp_path / "out"
    done = run_cli("train", "--model", f"{model}:build", "--stages", "2", "--microbatches",
                   "2", "--steps", "2", "--batch-size", "4", "--out", str(out), timeout=300)
    assert done.returncode == EXIT_RUN_FAILED, done.stderr
    assert "Traceback" not in done.stderr and "Traceback" not in done.stdout, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert errors == [line for line in done.stderr.splitlines()
                      if line.startswith("pipesched train: error: rank 1 failed")], done.stderr
    assert len(errors) == 1 and "planted failure on the last stage" in errors[0]
    assert f"full report: {out / 'failure.txt'}" in errors[0]
    report = (out / "failure.txt").read_text()
    assert "planted failure on the last stage" in report and "Traceback" in report


@pytest.mark.multiprocess
def test_ctrl_c_on_a_training_run_is_one_line(tmp_path: Path) -> None:
    # regression: Ctrl-C printed every rank's traceback; the terminal sends SIGINT to the
    # whole foreground process group, ranks included
    process = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "train", "--stages", "2", "--microbatches", "2",
         "--batch-size", "4", "--blocks", "2", "--steps", "3000", "--out", str(tmp_path)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert process.stdout is not None
    for line in process.stdout:  # "training 1f1b on 2 CPU ranks ..." then the progress
        if line.startswith("training"):
            break
    time.sleep(3.0)  # the ranks are up and stepping
    os.killpg(process.pid, signal.SIGINT)
    try:
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == EXIT_INTERRUPTED, stderr
    assert "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == "pipesched train: interrupted", stderr
    assert len([line for line in stderr.splitlines() if "rank" in line]) == 0, stderr
