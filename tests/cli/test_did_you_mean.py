"""A misspelt choice (a schedule, a subcommand) is answered with the closest names, in-process
through the console script's entry; an unrelated word gets the list alone."""

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
