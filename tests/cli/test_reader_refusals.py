"""The command line's refusals (issue 16, items 3 and 7): one line, exit 2, the value and the
fix, and at once: never a traceback, a hang on a FIFO, or a run until killed."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from pipeline.cli import main

HUGE = str(10**7)
LONG_NAME = "a" * 300


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`pipesched ARGS` in this process: (exit code, stdout, stderr)."""
    try:
        code = main(list(args))
    except SystemExit as exit_:  # argparse's usage errors
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def refused(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """stderr of a run that must exit 2 with a one-line error and no traceback."""
    code, out, err = run(capsys, *args)
    assert code == 2, (out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def refused_without_blocking(capsys: pytest.CaptureFixture[str], fifo: Path,
                             *args: str) -> str:
    """`refused`, run in a thread: should it block opening `fifo`, unblock it and fail."""
    result: list[str | BaseException] = []

    def target() -> None:
        try:
            result.append(refused(capsys, *args))
        except BaseException as error:  # an assertion, handed to the test below
            result.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout=60)
    if thread.is_alive():  # the bug: blocked in open(); open the other end to release it
        descriptor = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
        thread.join(timeout=10)
        os.close(descriptor)
        pytest.fail(f"pipesched {args[0]} blocked on the FIFO {fifo}")
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]




# --- issue 16, item 3: sizes that would run until killed -----------------------------------

@pytest.mark.parametrize("args", [
    ["simulate", "--schedule", "1f1b", "--stages", HUGE, "--microbatches", "8"],
    ["simulate", "--schedule", "interleaved", "--stages", "4", "--microbatches", "8",
     "--chunks", HUGE],
    ["schedule", "--schedule", "1f1b", "--stages", "4", "--microbatches", HUGE],
    ["schedule", "--schedule", "gpipe", "--stages", HUGE, "--microbatches", "8",
     "--compute-only"],
    ["compare", "--stages", "4", "--microbatches", HUGE],
    ["compare", "--stages", "4", "--microbatches", "8", "--chunks", HUGE],
])
@pytest.mark.usefixtures("generators_that_must_not_run")
def test_ten_million_stages_microbatches_or_chunks_exit_2_before_building(
        capsys: pytest.CaptureFixture[str], args: list[str]) -> None:
    # Was: ran until killed. Now refused from the estimate, before any generator runs.
    err = refused(capsys, *args)
    assert "10,000,000" in err and "MAX_INSTRUCTIONS" in err
    assert "lower --stages, --microbatches or --chunks" in err


def test_a_large_partition_request_is_refused_by_its_own_checks(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"layers": [{"forward": 1.0}] * 8}))
    assert "use at most 8 stages" in refused(capsys, "partition", "--costs", str(costs),
                                             "--stages", HUGE)
    code, out, _ = run(capsys, "partition", "--costs", str(costs), "--stages", "2",
                       "--microbatches", HUGE, "--json")
    assert code == 0 and json.loads(out)["num_stages"] == 2


# --- issue 16, item 7: the readers and the CLI edge ----------------------------------------

@pytest.mark.parametrize("command", ["simulate", "compare"])
@pytest.mark.parametrize("option", ["--forward", "--comm", "--backward", "--activation-bytes"])
def test_a_cost_of_1e308_is_refused_not_printed_as_inf_and_nan(
        capsys: pytest.CaptureFixture[str], command: str, option: str) -> None:
    # Was: makespan inf, bubble_rate NaN, and --json printed Infinity / NaN (invalid JSON).
    head = ["--schedule", "1f1b"] if command == "simulate" else []
    err = refused(capsys, command, *head, "--stages", "2", "--microbatches", "2", option,
                  "1e308", "--json")
    assert f"argument {option}: '1e308' is over the largest cost" in err
    assert "MAX_COST" in err and "larger unit" in err


def test_json_output_at_the_largest_costs_is_strict_json(
        capsys: pytest.CaptureFixture[str]) -> None:
    def strict(constant: str) -> None:
        raise AssertionError(f"{constant} in --json output")

    for command, head in (("simulate", ["--schedule", "1f1b"]), ("compare", [])):
        code, out, err = run(capsys, command, *head, "--stages", "4", "--microbatches", "8",
                             "--forward", "1e15", "--comm", "1e15", "--activation-bytes",
                             "1e15", "--json")
        assert code == 0, err
        json.loads(out, parse_constant=strict)


def test_a_300_character_output_name_is_refused_not_enametoolong(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # Was: OSError [Errno 36] File name too long, with a traceback.
    for option, suffix in (("--plot", ".png"), ("--memory-plot", ".svg"),
                           ("--trace", ".json")):
        err = refused(capsys, "simulate", "--schedule", "1f1b", "--stages", "2",
                      "--microbatches", "2", option, str(tmp_path / (LONG_NAME + suffix)))
        assert "File name too long" in err and "at most 255 bytes" in err
    err = refused(capsys, "validate", str(tmp_path / (LONG_NAME + ".txt")))
    assert "File name too long" in err


@pytest.mark.parametrize(("option", "name"), [("--plot", "out.png"), ("--trace", "out.json"),
                                              ("--memory-plot", "out.svg")])
def test_a_fifo_as_plot_or_trace_is_refused_not_waited_on(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, option: str, name: str) -> None:
    # Was: opening the FIFO to write waited for a reader forever.
    fifo = tmp_path / name
    os.mkfifo(fifo)
    err = refused_without_blocking(capsys, fifo, "simulate", "--schedule", "1f1b", "--stages",
                                   "2", "--microbatches", "2", option, str(fifo))
    assert "named pipe (FIFO), not a regular file" in err


def test_a_fifo_as_costs_or_schedule_file_is_refused_not_waited_on(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # Was: reading the FIFO waited for a writer forever.
    costs, schedule = tmp_path / "costs.json", tmp_path / "schedule.txt"
    os.mkfifo(costs)
    os.mkfifo(schedule)
    err = refused_without_blocking(capsys, costs, "partition", "--costs", str(costs),
                                   "--stages", "2")
    assert "named pipe (FIFO), not a regular file" in err
    err = refused_without_blocking(capsys, schedule, "validate", str(schedule))
    assert "named pipe (FIFO), not a regular file" in err
    assert "/dev/zero is a device, not a regular file" in refused(capsys, "validate", "/dev/zero")


def test_a_400_digit_integer_in_the_cost_file_exits_2(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # Was: OverflowError: int too large to convert to float, with a traceback.
    costs = tmp_path / "costs.json"
    costs.write_text('{"layers": [{"forward": 1' + "0" * 400 + '}, {"forward": 1}]}')
    err = refused(capsys, "partition", "--costs", str(costs), "--stages", "2")
    assert "forward=(an integer of about 401 digits) is not a finite number >= 0" in err


def test_validate_names_a_split_backward_missing_its_w(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # Was: "error: '<' not supported between instances of 'Kind' and 'Kind'".
    path = tmp_path / "split.txt"
    path.write_text("rank 0: 0F0 0I0 0F1 0I1 0W1\n")
    code, _, err = run(capsys, "validate", str(path))
    assert code == 2 and "'<' not supported" not in err
    assert "microbatch 0 has F+I; every (stage, microbatch) needs exactly F+B or F+I+W" in err


def test_validate_refuses_swapped_rank_labels(capsys: pytest.CaptureFixture[str],
                                              tmp_path: Path) -> None:
    # Was: "valid", with the labels ignored.
    path = tmp_path / "swapped.txt"
    path.write_text("rank 1: 0F0 0B0\nrank 0: 1F0 1B0\n")
    err = refused(capsys, "validate", str(path))
    assert "line 1 is labelled 'rank 1'" in err and "list the ranks in order" in err


def test_every_command_module_registers_the_command_it_is_listed_under() -> None:
    # `main` imports only the module of the command it runs: the table must match.
    from pipeline.cli import COMMAND_MODULES, build_parser

    for name in COMMAND_MODULES:
        choices = next(action for action in build_parser(name)._actions
                       if action.dest == "command").choices
        assert list(choices or ()) == [name]


def test_validate_refuses_a_file_too_large_to_lower(capsys: pytest.CaptureFixture[str],
                                                     tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # The limit that guards the generators guards lowering a user's compute-only file too
    # (at the real limit, such a file takes minutes; a small limit shows the wiring).
    monkeypatch.setattr("schedules.ir.limits.MAX_INSTRUCTIONS", 20)
    path = tmp_path / "gpipe.txt"
    path.write_text("0F0 0F1 0F2 0B0 0B1 0B2\n1F0 1F1 1F2 1B0 1B1 1B2\n")
    err = refused(capsys, "validate", str(path))
    assert "ranks 2, microbatches 3, stages per rank 1 would build 40 instructions" in err
