"""Run the `pipesched` command line as a user would: in a subprocess, or in-process through the
entry point the console script calls (`pipeline.cli:main`) where only the refusal is tested."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

__all__ = ["REPO", "call_cli", "run_cli"]

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`python -m pipeline.cli ARGS` from the repository root; never raises on exit codes."""
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, check=False)


def call_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`pipeline.cli.main(ARGS)` in this process from the repository root, with its exit code
    (argparse's `SystemExit` included), stdout and stderr, as `run_cli` returns them.

    For commands that are refused or answer without launching ranks: a second interpreter
    costs seconds of imports and proves nothing more (tests/cli/test_exit_codes.py keeps
    one subprocess run of the console script's module)."""
    from pipeline.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(REPO), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as stop:  # argparse: --help (0) and usage errors (2)
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    return subprocess.CompletedProcess(["pipesched", *args], code, out.getvalue(), err.getvalue())
