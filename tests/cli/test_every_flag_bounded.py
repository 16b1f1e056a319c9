"""Every flag of every command is bounded, found by walking the argparse definitions so that a
new flag cannot escape: a flag naming a file to read goes through `pipeline.files`
(`InputFileType`) and refuses a FIFO, /dev/zero and deep JSON when the command line is parsed;
a numeric flag refuses inf, NaN, 1e400 and a 300-digit number; the few text flags are listed
here with the parser that bounds them, and their huge values are refused too."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.cli import COMMAND_MODULES, build_parser, main
from pipeline.cli.options import (
    cost_number,
    fraction,
    non_negative_float,
    positive_float,
    positive_int,
    seed_int,
    timeout_seconds,
)
from pipeline.cli.output_paths import figure_path, trace_path
from pipeline.cli.validate_cmd import MAX_VALIDATED_RANKS
from pipeline.files import InputFileType, OutputFileType
from schedules import build_schedule
from tests.support.cli_helpers import REPO

_COSTS = str(REPO / "benchmarks" / "costs" / "uniform16.json")
_SHAPE = "layers=4,hidden=64,heads=4,vocab=128,seq=32"

_NUMERIC_TYPES = {positive_int, positive_float, non_negative_float, cost_number,
                  timeout_seconds, fraction, seed_int}
_OUTPUT_TYPES = {figure_path, trace_path}
_TEXT_FLAGS = {  # (command, flag) -> how its value is bounded
    ("partition", "--method"): "one of the partition methods (partition.parse_method)",
    ("partition", "--boundaries"): "parse_cuts: numbers, each finite and <= MAX_NUMBER",
    ("partition", "--memory-cap"): "parse_bytes: 1..MAX_NUMBER bytes",
    ("partition", "--speeds"): "parse_numbers, then a speed range",
    ("partition", "--bandwidth"): "parse_bytes: 1..MAX_NUMBER bytes",
    ("train", "--schedule"): "a schedule name (checked against SCHEDULES)",
    ("train", "--partition"): "a partition method name",
    ("rehearse", "--schedule"): "a schedule name",
    ("rehearse", "--partition"): "a partition method name",
    ("plan", "--schedules"): "schedule names",
    ("plan", "--tensor-parallel"): "plan_filters.parse_sizes: 1..MAX_COUNT each",
    ("plan", "--pp"): "plan_filters.parse_sizes", ("plan", "--tp"): "plan_filters.parse_sizes",
    ("plan", "--dp"): "plan_filters.parse_sizes", ("plan", "--ep"): "plan_filters.parse_sizes",
    ("plan", "--cp"): "plan_filters.parse_sizes",
    ("plan", "--microbatch-size"): "plan_filters.parse_sizes",
    ("plan", "--zero"): "0, 1, 2 or 3 each", ("plan", "--recompute"): "mode names",
    ("plan", "--price"): "parse_config: each item once, sizes dividing the devices",
    ("compare", "--schedules"): "schedule_names: known names",
    ("profile-device", "--sizes"): "_sizes: at most 8 sizes of at most 8192",
    ("profile-device", "--repeats"): "_repeats: at most 100",
    ("rehearse", "--weight-fraction"): "a fraction in [0, 1]",
    ("train", "--out"): "an output directory (created)",
    ("rehearse", "--out"): "an output directory (created)",
    ("verify-checkpoint", "path"): "a checkpoint directory: each file read bounded "
                                   "(tests/checkpoint/test_tampering.py)",
    ("run", "--data"): "a token file, memory-mapped (any size): a regular file or refused "
                       "(tests/jobs/test_token_data.py)",
    ("run", "--partition"): "run_cmd._partition: rising cuts 0..the model's layers, or a "
                            "method name",
    ("run", "--checkpoint"): "a checkpoint directory (created; loads read bounded)",
    ("run", "--tensorboard"): "an output directory (refused without tensorboard installed)",
}
_HUGE = ["inf", "nan", "1e400", "-1e400", "9" * 300]


def _flags() -> Iterator[tuple[str, argparse.Action]]:
    for command in COMMAND_MODULES:
        parser = build_parser(command)
        sub = next(action for action in parser._actions
                   if isinstance(action, argparse._SubParsersAction)).choices[command]
        for action in sub._actions:
            if action.nargs == 0 or isinstance(action, argparse._HelpAction):
                continue  # a switch holds no value
            yield command, action


def _name(action: argparse.Action) -> str:
    return action.option_strings[0] if action.option_strings else action.dest


def _argv(command: str, action: argparse.Action, value: str) -> list[str]:
    return [command, *action.option_strings[:1], value]


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        build_parser(argv[0]).parse_args(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert "Traceback" not in err
    return err


def test_every_flag_is_classified() -> None:
    """A new flag must read through `pipeline.files`, take a bounded numeric type, offer
    choices, or be listed above with what bounds it."""
    unclassified = []
    for command, action in _flags():
        if action.choices is not None or isinstance(action.type, InputFileType | OutputFileType) \
                or action.type in _NUMERIC_TYPES | _OUTPUT_TYPES \
                or (command, _name(action)) in _TEXT_FLAGS:
            continue
        unclassified.append(f"{command} {_name(action)} (type {action.type!r})")
    assert not unclassified, unclassified


def test_the_walk_finds_the_flags_that_escaped_before() -> None:
    found = {(command, _name(action)) for command, action in _flags()}
    for flag in [("plan", "--device-profile"), ("profile-device", "--output"),
                 ("profile-device", "--repeats"), ("partition", "--costs"),
                 ("rehearse", "--costs"), ("validate", "file"), ("train", "--model")]:
        assert flag in found


@pytest.fixture
def unbounded(tmp_path: Path) -> dict[str, Path]:
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as handle:  # sparse: costs no disk
        handle.truncate((64 << 20) + 1)
    return {"fifo": fifo, "dev-zero": Path("/dev/zero"), "deep": deep, "huge": huge}


def test_every_file_reading_flag_refuses_fifo_dev_zero_deep_and_huge_files(
        unbounded: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    # regression: plan --device-profile blocked on a FIFO, raised MemoryError on /dev/zero
    # and RecursionError on deep JSON
    checked = 0
    for command, action in _flags():
        if not isinstance(action.type, InputFileType):
            continue
        for kind, path in unbounded.items():
            if kind == "deep" and not action.type.json_document:
                continue
            value = f"{path}:build" if action.type.suffix_separator else str(path)
            err = _refused(capsys, _argv(command, action, value))
            assert str(path) in err and len(err.strip().splitlines()) == 1, (command, err)
            checked += 1
    assert checked >= 7 * 3


def test_an_output_flag_naming_a_fifo_is_refused(unbounded: dict[str, Path],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # regression: profile-device --output FIFO ran past 300 s
    for command, action in _flags():
        if isinstance(action.type, OutputFileType) or action.type in _OUTPUT_TYPES:
            _refused(capsys, _argv(command, action, str(unbounded["fifo"])))


def test_every_numeric_flag_refuses_huge_values(capsys: pytest.CaptureFixture[str]) -> None:
    checked = 0
    for command, action in _flags():
        if action.type not in _NUMERIC_TYPES:
            continue
        assert action.type is not None
        action.type("1")  # a sane value passes: the refusals below are of the size
        for value in _HUGE:
            _refused(capsys, _argv(command, action, value))
            checked += 1
    assert checked >= 40 * len(_HUGE)


@pytest.mark.parametrize("argv", [
    ["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "2",
     "--optimizer-factor", "1e308"],  # printed inf, invalid JSON with --json
    ["simulate", "--schedule", "dualpipev-overlap", "--stages", "2", "--microbatches", "4",
     "--overlap", "1e12"],  # accepted as a "fraction"
    ["train", "--seed", str(-10**30)],  # "Overflow when unpacking long long"
    ["profile-device", "--output", "x.json", "--repeats", "1000000"],  # ran past 300 s
    ["profile-device", "--output", "x.json", "--sizes", "20000"],  # ran past 300 s
    ["profile-device", "--output", "x.json", "--sizes", "100000"],  # out of memory
])
def test_the_reported_absurd_values_are_refused_when_parsed(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    _refused(capsys, argv)


@pytest.mark.parametrize(("argv", "message"), [
    (["partition", "--costs", _COSTS, "--stages", "2", "--bandwidth", "1e-300"],
     "outside 1..1e+15"),  # printed a 300-digit number
    (["partition", "--costs", _COSTS, "--stages", "2", "--memory-cap", "1e400"],
     "outside 1..1e+15"),
    (["partition", "--costs", _COSTS, "--stages", "2", "--speeds", "1,1e400"],
     "every number must be finite"),
    (["plan", "--model", _SHAPE, "--cluster", "a100-80g", "--global-batch", "8",
      "--price", "pp2,rc,rc2"], "both set the recomputation"),  # the last rc won silently
    (["plan", "--model", _SHAPE, "--cluster", "a100-80g", "--global-batch", "8",
      "--pp", "9" * 300], "must be whole numbers in 1.."),
])
def test_text_flags_refuse_absurd_values(argv: list[str], message: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_validate_has_a_work_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # regression: validate of a valid 100,000-rank schedule took 131 s
    path = tmp_path / "wide.txt"
    path.write_text(build_schedule("1f1b", MAX_VALIDATED_RANKS + 1, 1).format())
    assert main(["validate", str(path)]) == 2
    assert f"{MAX_VALIDATED_RANKS + 1:,} ranks, over the" in capsys.readouterr().err


def test_plan_refuses_a_cost_file_with_an_absurd_forward_time(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # regression: a forward of 1e300 s printed a 300-digit plan with exit 0
    costs = tmp_path / "costs.json"
    costs.write_text('{"layers": [{"name": "a", "forward": 1e300, "backward": 1, '
                     '"params": 4, "activation": 4}, {"name": "b", "forward": 1, '
                     '"backward": 1, "params": 4, "activation": 4}]}')
    assert main(["plan", "--model", str(costs), "--cluster", "a100-80g",
                 "--global-batch", "8"]) == 2
    err = capsys.readouterr().err
    assert "forward 1e+300, over 1e+15" in err and "Traceback" not in err, err
