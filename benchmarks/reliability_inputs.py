"""Trials for the reliability report that feed the system bad input rather than faults: huge
sizes on the command line, steps that used to train silently wrong, two jobs on one
checkpoint root. Each returns (tried, clean, hang, traceback, silent)."""

from __future__ import annotations

import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

from pipeline import PipelineEngine, PipelineModule, launch
from pipeline.runtime.schedule_setup import resolve_schedule
from tests.checkpoint.test_root_lock import test_a_second_job_cannot_sweep_away_a_save_in_progress
from tests.runtime.test_silent_steps import _module, _scenarios
from tests.support.cli_helpers import REPO

__all__ = ["HUGE_INPUTS", "concurrent_writers", "huge_inputs", "silent_steps"]

Tally = tuple[int, int, int, int, int]

HUGE_INPUTS: tuple[tuple[str, ...], ...] = (
    ("simulate", "--stages", "10000000"),
    ("simulate", "--microbatches", "10000000"),
    ("schedule", "--schedule", "interleaved", "--chunks", "10000000"),
    ("compare", "--stages", "10000000"),
    ("simulate", "--forward", "1e308", "--json"),
    ("train", "--seq-len", "10000000"),
    ("train", "--batch-size", "8000000000000"),
    ("train", "--width", "1000000"),
    ("train", "--blocks", "100000"),
    ("train", "--stages", "5000", "--blocks", "20000"),
)
_ADDRESS_SPACE = 8 * 2**30  # a regression dies of MemoryError instead of exhausting the host


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (_ADDRESS_SPACE, _ADDRESS_SPACE))


def huge_inputs(timeout: float = 120.0) -> Tally:
    """Each command must end at once with exit 2 and one line naming the limit."""
    clean = hang = traceback = silent = 0
    print("| command | outcome | first line |\n|---|---|---|")
    with tempfile.TemporaryDirectory() as out:
        for arguments in HUGE_INPUTS:
            extra = ("--out", out, "--steps", "1") if arguments[0] == "train" else ()
            try:
                result = subprocess.run([sys.executable, "-m", "pipeline.cli", *arguments,
                                         *extra], cwd=REPO, capture_output=True, text=True,
                                        timeout=timeout, check=False, preexec_fn=_limited)
            except subprocess.TimeoutExpired:
                hang += 1
                print(f"| {' '.join(arguments)} | hang | |", flush=True)
                continue
            lines = result.stderr.strip().splitlines()
            if "Traceback" in result.stderr:
                traceback, outcome = traceback + 1, "traceback"
            elif result.returncode == 2 and len(lines) == 1:
                clean, outcome = clean + 1, "refused"
            else:
                silent, outcome = silent + 1, f"exit {result.returncode}"
            print(f"| {' '.join(arguments)} | {outcome} | {lines[0][:90] if lines else ''} |",
                  flush=True)
    return len(HUGE_INPUTS), clean, hang, traceback, silent


def silent_steps() -> Tally:
    """The steps that trained silently wrong, on 2 ranks (refused or reported on every rank)
    and in one process (refused before any rank starts)."""
    expected = {"batch sizes 8 vs 4": "inputs hold 8 samples", "empty batch": "empty batch",
                "factory returns None": "optimizer factory returned None",
                "nan input": "stage 0, microbatch 1", "nan target": "the loss of stage 1"}
    per_rank = launch(_scenarios, 2, timeout=60, join_timeout=300)
    outcomes = {name: all(text in str(seen[name]) for seen in per_rank)
                for name, text in expected.items()}
    outcomes["skipped step keeps the weights"] = all(seen["skip"] == (True, True, True)
                                                     for seen in per_rank)
    checks = {
        "a layer class": lambda: PipelineModule([nn.Linear], num_stages=1),
        "device=cuda without CUDA": lambda: PipelineEngine(
            _module(), schedule="1f1b", num_microbatches=2, device=torch.device("cuda")),
        "a million microbatches": lambda: resolve_schedule("1f1b", _module(), 10**6),
    }
    for name, call in checks.items():
        try:
            call()
            outcomes[name] = False
        except (TypeError, ValueError):
            outcomes[name] = True
    print("| step | refused or reported |\n|---|---|")
    for name, ok in outcomes.items():
        print(f"| {name} | {'yes' if ok else 'NO (silent)'} |")
    clean = sum(outcomes.values())
    return len(outcomes), clean, 0, 0, len(outcomes) - clean


def concurrent_writers(repeats: int = 1) -> Tally:
    """Two jobs saving into one checkpoint root, the first paused mid-save: the second is
    refused naming the holder and the first completes (`tests/checkpoint/test_root_lock.py`)."""
    clean = hang = traceback = 0
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as workdir:
            try:
                test_a_second_job_cannot_sweep_away_a_save_in_progress(Path(workdir))
                clean += 1
            except TimeoutError:
                hang += 1
            except Exception as error:  # the report counts it; it must not stop the others
                traceback += 1
                print(f"concurrent writers: {type(error).__name__}: {error}", flush=True)
    return repeats, clean, hang, traceback, 0
