"""A misspelt choice (a schedule, a subcommand) is answered with the closest names, in-process
through the console script's entry; an unrelated word gets the list alone; refusals come
before torch is imported."""

from __future__ import annotations

import pytest

from pipeline.cli import did_you_mean, main
from schedules import ScheduleConfigError, generate_schedule


@pytest.mark.parametrize(("argv", "suggestion"), [
    (["train", "--schedule", "zbv"], "did you mean 'zb-v'?"),
    (["simulate", "--schedule", "interleavd"], "did you mean 'interleaved' or 'interleaved-zb'?"),
    (["trian"], "did you mean 'train'?"),
])
def test_a_typo_names_the_closest_choices(argv: list[str], suggestion: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith(suggestion), lines


def test_a_far_word_gets_no_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--schedule", "qqqq"])
    assert "did you mean" not in capsys.readouterr().err


def test_only_invalid_choice_messages_get_a_suggestion() -> None:
    assert did_you_mean("argument --steps: invalid int value: 'zbv'") == ""
    assert did_you_mean("invalid choice: 'gpipee' (choose from 'gpipe', '1f1b')") \
        == "; did you mean 'gpipe'?"


def test_the_schedule_registry_suggests_too() -> None:
    with pytest.raises(ScheduleConfigError, match=r"did you mean 'zb-h1' or 'zb-h2'\?"):
        generate_schedule("zb_h1", 2, 4)


@pytest.mark.parametrize("argv", [
    ["train", "--model", "nothere.py:build"],
    ["train", "--schedule", "zbv"],
    ["plan", "--model", "nothere.json", "--cluster", "local", "--global-batch", "8"],
    ["train", "--tp", "2"],
    ["train", "--schedule", "forward-only"],
    ["run", "--model", "nothere", "--data", "nothere.bin", "--steps", "1"],
    ["rehearse", "--schedule", "1f1b", "--stages", "2", "--microbatches", "4",
     "--costs", "nothere.json"],
])
def test_a_refusal_comes_before_torch_is_imported(argv: list[str]) -> None:
    # issue 46: a refusal waited for torch's import (1-2 s quiet, 10-35 s loaded)
    import subprocess
    import sys

    from tests.support.cli_helpers import REPO

    script = ("import sys\nfrom pipeline.cli import main\ntry:\n    code = main(sys.argv[1:])\n"
              "except SystemExit as stop:\n    code = stop.code\n"
              "print('torch' in sys.modules)\nsys.exit(code)")
    done = subprocess.run([sys.executable, "-c", script, *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert done.stdout.strip() == "False", (argv, done.stderr)
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
