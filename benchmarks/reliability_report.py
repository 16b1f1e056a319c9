"""The reliability figures for the README: faults injected and survived, launchers killed
and stalled ranks named, crashes during a save and corrupt checkpoints refused, fuzz cases.

    python benchmarks/reliability_report.py            # everything (~8 min on 2 cores)
    python benchmarks/reliability_report.py --quick    # no launched jobs (~1 min)
    python benchmarks/reliability_report.py --repeats 3   # each launcher kill / stall 3 times
    python benchmarks/reliability_report.py --only kills --repeats 3   # 60 launcher kills
    python benchmarks/reliability_report.py --only inputs   # 800+ bad CLI inputs (~? min)
    python benchmarks/reliability_report.py --only api      # API misuse

A killed launcher ends "clean" when every rank, the fork server and the resource tracker end
within 30 s and nothing is left in TMPDIR; "hang" when a process outlives that, "traceback"
when a rank prints one instead of its one-line exit (`tests/support/orphan_job.py`). A stall
ends "clean" when `RankFailedError` names the stalled rank and no process survives, "hang"
when only join_timeout ends it, "traceback" when the error names another rank, "silent"
when the job ends without an error (`tests/support/stall_scenarios.py`).

"Survived" means the job ended as it must: `RankFailedError` naming the right rank, every
rank exited non-zero, no process outlived the launcher, and after a kill during a save a
new job resumed from the last complete checkpoint (`tests/support/fault_scenarios.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks.reliability_api import api_misuse
from benchmarks.reliability_cli import cli_inputs
from benchmarks.reliability_inputs import concurrent_writers, huge_inputs, silent_steps
from pipeline.checkpoint.load import load_checkpoint
from pipeline.checkpoint.save import save_checkpoint
from pipeline.errors import CheckpointError
from pipeline.supervision import faults
from tests.partition import test_fuzz_files
from tests.schedules import test_fuzz_readers
from tests.support.checkpoint_cases import Job, corruption_cases
from tests.support.fault_scenarios import SCENARIOS, run_scenario
from tests.support.fuzz_counts import COUNTS
from tests.support.orphan_job import KILL_POINTS, kill_launcher
from tests.support.stall_scenarios import STALLS, run_stall

Tally = tuple[int, int, int, int, int]
"""tried, clean, hang, traceback, silent"""
_KILLS = [(method, sig) for method in ("forkserver", "spawn", "fork", "torchrun")
          for sig in (signal.SIGKILL, signal.SIGTERM)]


def _faults(workdir: str) -> tuple[int, int]:
    print("| fault injected | ended cleanly | seconds |\n|---|---|---|")
    survived = 0
    for index, scenario in enumerate(SCENARIOS):
        outcome = run_scenario(scenario, os.path.join(workdir, f"fault{index}"))
        survived += outcome.survived
        verdict = "yes" if outcome.survived else "NO: " + "; ".join(outcome.problems)
        print(f"| {scenario.name} | {verdict} | {outcome.seconds:.1f} |", flush=True)
    return survived, len(SCENARIOS)


def _launcher_kills(workdir: str, repeats: int) -> Tally:
    """Kill the launcher at every start-up point (forkserver) with SIGINT, SIGTERM and
    SIGKILL, and while it trains and saves under every start method."""
    print("| launcher killed | start method | at | clean | hang | traceback | "
          "all gone after (s) | problems |\n|---|---|---|---|---|---|---|---|")
    trials = [(method, sig, "training") for method, sig in _KILLS] + [
        ("forkserver", sig, point) for point in KILL_POINTS if point != "training"
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)]
    tried = clean = hang = traceback = silent = 0
    for trial in range(repeats):
        for index, (method, sig, point) in enumerate(trials):
            outcome = kill_launcher(os.path.join(workdir, f"kill{trial}-{index}"), method, sig,
                                    point)
            if not outcome.started:
                print(f"| {sig.name} | {method} | {point} | (did not start) | | | | |",
                      flush=True)
                continue
            tried += 1
            clean += outcome.clean and not outcome.traceback
            hang += outcome.hung
            traceback += outcome.traceback
            silent += not outcome.clean and not outcome.hung and not outcome.traceback
            print(f"| {sig.name} | {method} | {point} | {outcome.clean} | {outcome.hung} | "
                  f"{outcome.traceback} | {outcome.seconds:.1f} | "
                  f"{'; '.join(outcome.problems)} |", flush=True)
    return tried, clean, hang, traceback, silent


def _stalls(workdir: str, repeats: int) -> Tally:
    print("| stall | named the stalled rank | hang | error (first line) |\n|---|---|---|---|")
    tried = clean = hang = traceback = silent = 0
    for trial in range(repeats):
        for where, name in STALLS.items():
            outcome = run_stall(where, os.path.join(workdir, f"stall{trial}-{where}"))
            tried += 1
            ended_silently = outcome.error == "the job finished without an error"
            clean += outcome.named and outcome.clean
            hang += outcome.hung
            silent += ended_silently
            traceback += not (outcome.named or outcome.hung or ended_silently)
            print(f"| {name} | {outcome.named} | {outcome.hung} | "
                  f"{outcome.error.splitlines()[0][:160]} |", flush=True)
    return tried, clean, hang, traceback, silent


def _tally_row(label: str, tally: Tally) -> str:
    tried, clean, hang, traceback, silent = tally
    return f"| {label} | {tried} | {clean} | {hang} | {traceback} | {silent} |"


class _Crash(Exception):
    pass


def _raise() -> None:
    raise _Crash


def _crashes_during_save(workdir: str) -> tuple[int, int]:
    """In one process: crash at every fault point of a save (new step, and re-saving the
    same step); the root must still load the previous checkpoint."""
    survived = total = 0
    for replace in (False, True):
        for point in faults.FAULT_POINTS:
            if point == "checkpoint.swap" and not replace:
                continue  # only a re-save swaps directories
            root = os.path.join(workdir, f"crash-{replace}-{point}")
            job = Job()
            job.train(1)
            save_checkpoint(root, job.parts())
            if not replace:
                job.train(1)
            points = faults.FaultPoints()
            points.arm(point, _raise)
            total += 1
            try:
                save_checkpoint(root, dataclasses.replace(job.parts(), faults=points))
            except _Crash:
                pass
            survived += load_checkpoint(root, Job(base_seed=3).parts()).step == 1
    return survived, total


def _corruptions(workdir: str) -> tuple[int, int]:
    job = Job()
    job.train(2)
    pristine = Path(save_checkpoint(os.path.join(workdir, "pristine"), job.parts()).directory)
    refused = 0
    cases = corruption_cases(str(pristine))
    for index, (_, _, corrupt) in enumerate(cases):
        root = Path(workdir, f"corrupt{index}")
        shutil.copytree(pristine.parent, root)
        named = os.path.basename(corrupt(str(root / pristine.name)))
        fresh = Job(base_seed=5)
        before = fresh.weights()
        try:
            load_checkpoint(str(root), fresh.parts())
        except CheckpointError as error:
            untouched = all(torch.equal(fresh.weights()[k], v) for k, v in before.items())
            refused += named in str(error) and untouched
        shutil.rmtree(root)
    return refused, len(cases)


def _fuzz() -> int:
    tests: list[Callable[[], None]] = [
        test_fuzz_readers.test_fuzz_parse_instruction, test_fuzz_readers.test_fuzz_parse_stream,
        test_fuzz_readers.test_fuzz_schedule_from_text,
        test_fuzz_readers.test_fuzz_parse_torch_csv,
        test_fuzz_readers.test_fuzz_validate_command_file,
        test_fuzz_files.test_fuzz_cost_json_documents, test_fuzz_files.test_fuzz_cost_json_bytes,
        test_fuzz_files.test_fuzz_manifest, test_fuzz_files.test_fuzz_latest_pointer]
    for test in tests:
        test()  # raises if anything but our typed errors escaped
    print("| fuzz target | examples |\n|---|---|")
    for name, count in COUNTS.items():
        print(f"| {name} | {count} |")
    return sum(COUNTS.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the launched fault jobs")
    parser.add_argument("--repeats", type=int, default=1, metavar="N",
                        help="run each launcher kill and each stall N times (default 1)")
    parser.add_argument("--only", choices=("kills", "inputs", "api"), default=None,
                        help="run one class of trials only (launcher kills, CLI inputs, API "
                             "misuse)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.only is not None:
        _only(args.only, args.repeats)
        return
    workdir = tempfile.mkdtemp(prefix="pipesched-reliability-")
    start = time.monotonic()
    try:
        faults_row = (0, 0) if args.quick else _faults(workdir)
        kills = (0,) * 5 if args.quick else _launcher_kills(workdir, args.repeats)
        stalls = (0,) * 5 if args.quick else _stalls(workdir, args.repeats)
        writers = (0,) * 5 if args.quick else concurrent_writers(args.repeats)
        steps = (0,) * 5 if args.quick else silent_steps()
        huge = huge_inputs()
        inputs = cli_inputs()
        misuse = api_misuse()
        crashes = _crashes_during_save(workdir)
        corrupt = _corruptions(workdir)
        fuzz_cases = _fuzz()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"\n| figure | value |\n|---|---|\n"
          f"| faults injected into launched jobs, survived | {faults_row[0]} / {faults_row[1]} |\n"
          f"| crashes at every moment of a save (in process), survived | "
          f"{crashes[0]} / {crashes[1]} |\n"
          f"| corrupt-checkpoint cases refused, naming the file | {corrupt[0]} / {corrupt[1]} |\n"
          f"| fuzz cases run, nothing but our typed errors escaped | {fuzz_cases} |\n"
          f"{_inputs_row(inputs)}\n"
          f"\n| trials | tried | clean | hang | traceback | silent |\n|---|---|---|---|---|---|\n"
          f"{_tally_row(_KILL_LABEL, kills)}\n"
          f"{_tally_row('stalled rank named (SIGSTOP, slow set-up, slow save)', stalls)}\n"
          f"{_tally_row('two jobs saving into one checkpoint root', writers)}\n"
          f"{_tally_row('steps that trained silently wrong (2 ranks and API)', steps)}\n"
          f"{_tally_row('huge sizes on the command line (exit 2, one line)', huge)}\n"
          f"{_tally_row(_MISUSE_LABEL, misuse)}\n"
          f"\n({time.monotonic() - start:.0f} s)")


_KILL_LABEL = ("launcher killed: 4 start-up points × SIGINT/SIGTERM/SIGKILL, training and "
               "saving × 4 start methods (traceback = a Python traceback after the kill; "
               "not clean = an orphan or a stray temporary directory)")
_MISUSE_LABEL = "API misuse (traceback = a bare AttributeError or an unexpected type)"


def _inputs_row(inputs: tuple[int, int, int, int, int, int]) -> str:
    tried, clean, hang, traceback, memory, silent = inputs
    return (f"| bad CLI inputs on every subcommand: tried / clean / hang / traceback / out of "
            f"memory / silent | {tried} / {clean} / {hang} / {traceback} / {memory} / "
            f"{silent} |")


def _only(which: str, repeats: int) -> None:
    start = time.monotonic()
    if which == "inputs":
        print(f"\n| figure | value |\n|---|---|\n{_inputs_row(cli_inputs())}")
    else:
        workdir = tempfile.mkdtemp(prefix="pipesched-reliability-")
        try:
            label, tally = (_KILL_LABEL, _launcher_kills(workdir, repeats)) \
                if which == "kills" else (_MISUSE_LABEL, api_misuse())
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        print(f"\n| trials | tried | clean | hang | traceback | silent |\n"
              f"|---|---|---|---|---|---|\n{_tally_row(label, tally)}")
    print(f"\n({time.monotonic() - start:.0f} s)")


if __name__ == "__main__":
    main()
