"""Twenty natural command-line mistakes: each must be one line on stderr, exit 2, in under a
second on a quiet machine (issue 46). Each runs as a user runs it (`python -m pipeline.cli`,
a fresh process), timed from start to exit; the table says whether torch was imported first.

    python benchmarks/bench_cli_refusals.py            # one run of each
    python benchmarks/bench_cli_refusals.py --repeat 3 # the median of three
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["MISTAKES", "main"]

REPO = Path(__file__).resolve().parents[1]

MISTAKES: tuple[tuple[str, ...], ...] = (
    ("train", "--schedule", "zbv"),
    ("train", "--stages", "0"),
    ("train", "--steps", "-1"),
    ("train", "--microbatches", "three"),
    ("train", "--model", "nothere.py:build"),
    ("train", "--tp", "2"),
    ("train", "--expert-parallel", "2"),
    ("train", "--schedule", "forward-only"),
    ("train", "--stages", "4", "--data-parallel", "64"),
    ("simulate", "--schedule", "1f1b", "--stages", "4", "--microbatches", "0"),
    ("simulate", "--schedule", "interleavd", "--stages", "4", "--microbatches", "8"),
    ("schedule", "--schedule", "gpipe", "--stages", "4", "--microbatches", "8", "--chunks", "3"),
    ("plan", "--model", "nothere.json", "--cluster", "local", "--global-batch", "8"),
    ("plan", "--model", "layers=2,hidden=64", "--cluster", "a100-80g", "--global-batch", "8"),
    ("plan", "--model", "layers=2,hidden=64,heads=4,vocab=128,seq=32", "--cluster", "a1000",
     "--global-batch", "8"),
    ("plan", "--model", "layers=2,hidden=64,heads=4,vocab=128,seq=32", "--cluster", "a100-80g",
     "--global-batch", "0"),
    ("verify-checkpoint", "nothere"),
    ("run", "--model", "nothere", "--data", "nothere.bin", "--steps", "1"),
    ("trian",),
    ("rehearse", "--schedule", "1f1b", "--stages", "2", "--microbatches", "4",
     "--costs", "nothere.json"),
)

PROBE = ("import sys, time\nfrom pipeline.cli import main\ntry:\n    code = main(sys.argv[1:])\n"
         "except SystemExit as stop:\n    code = stop.code\n"
         "sys.stderr.write('torch imported\\n' if 'torch' in sys.modules else '')\n"
         "sys.exit(code)")


def _one(argv: tuple[str, ...], where: str) -> tuple[float, int, list[str], bool]:
    """Seconds from start to exit, the exit code, stderr's lines (less the probe's) and
    whether torch was imported."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=where, text=True,
                          capture_output=True, timeout=300, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    seconds = time.perf_counter() - started
    lines = done.stderr.strip().splitlines()
    torch = "torch imported" in lines
    return seconds, done.returncode, [line for line in lines if line != "torch imported"], torch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.1f} at the start; median of {args.repeat}")
    print("| mistake | seconds | exit | lines | torch imported | first line |")
    print("|---|---|---|---|---|---|")
    slow = 0
    with tempfile.TemporaryDirectory() as where:
        for mistake in MISTAKES:
            runs = [_one(mistake, where) for _ in range(args.repeat)]
            seconds = statistics.median(run[0] for run in runs)
            _, code, lines, torch = runs[-1]
            slow += seconds > 1.0 or code != 2 or len(lines) != 1
            first = (lines[0] if lines else "").replace("|", "\\|")[:90]
            print(f"| `{' '.join(mistake)}` | {seconds:.2f} | {code} | {len(lines)} | "
                  f"{'yes' if torch else 'no'} | {first} |")
    print(f"\n{len(MISTAKES) - slow} of {len(MISTAKES)} answered in one line, exit 2, "
          f"under 1 s; load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
