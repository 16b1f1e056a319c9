"""Run the `pipesched` command line in a subprocess, as a user would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

__all__ = ["REPO", "run_cli"]

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`python -m pipeline.cli ARGS` from the repository root; never raises on exit codes."""
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, check=False)
