"""A closed or full standard output does not fail a run: one warning on stderr, the run's
own exit code, every output file written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.test_train import TINY
from tests.support.cli_helpers import REPO

_STDOUTS = {"closed": ">&-", "full": ">/dev/full"}


def _run_with_stdout(stdout: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m pipeline.cli ARGS` with its stdout closed or on /dev/full (as a shell
    user's `>&-` / `> /dev/full`); stderr captured."""
    command = " ".join([sys.executable, "-m", "pipeline.cli", *args])
    return subprocess.run(["bash", "-c", f"exec {command} {_STDOUTS[stdout]}"], cwd=REPO,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          timeout=300, check=False)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stdout", sorted(_STDOUTS))
def test_a_closed_or_full_stdout_does_not_fail_training(tmp_path: Path, stdout: str) -> None:
    # regression: `pipesched train >&-` failed the run (rank 0: "Bad file descriptor",
    # exit 3); `> /dev/full` trained and then exited 2, the invalid-input code
    done = _run_with_stdout(stdout, "train", *TINY, "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    warnings = [line for line in done.stderr.splitlines() if "standard output" in line]
    assert len(warnings) == 1, done.stderr
    assert warnings[0].startswith("pipesched: warning: cannot write to standard output (")
    assert warnings[0].endswith("the run goes on")
    assert len(json.loads((tmp_path / "summary.json").read_text())["losses"]) == 2


@pytest.mark.parametrize("stdout", sorted(_STDOUTS))
def test_a_closed_or_full_stdout_keeps_a_commands_exit_code(stdout: str) -> None:
    done = _run_with_stdout(stdout, "schedule", "--schedule", "1f1b", "--stages", "4",
                            "--microbatches", "64")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "warning: cannot write" in done.stderr
    refused = _run_with_stdout(stdout, "schedule", "--schedule", "nope")
    assert refused.returncode == 2 and "invalid choice" in refused.stderr
