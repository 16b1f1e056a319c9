"""docs/cli.md is the generator's output, and the generator shows every flag of every command."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pipeline.cli import COMMAND_MODULES, build_parser
from pipeline.cli.reference import command_reference

CLI_PAGE = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def test_docs_cli_page_equals_the_generated_reference() -> None:
    assert CLI_PAGE.read_text() == command_reference(), (
        "docs/cli.md is out of date: run `python -m pipeline.cli.reference > docs/cli.md`")


def test_the_reference_names_every_command_and_every_flag() -> None:
    # The oracle walks argparse's own tables, independently of the generator's rendering.
    reference = command_reference()
    subparsers = next(action for action in build_parser()._actions
                      if isinstance(action, argparse._SubParsersAction))
    assert set(subparsers.choices) == set(COMMAND_MODULES)
    for name, parser in subparsers.choices.items():
        section = reference.split(f"## `pipesched {name}`", 1)[1].split("\n## ", 1)[0]
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for option in action.option_strings:
                assert f"`{option}`" in section, f"{option} of pipesched {name} is missing"
            if not action.option_strings:
                assert f"`{action.metavar or action.dest}`" in section


def test_the_reference_does_not_depend_on_the_terminal_width(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "40")
    narrow = command_reference()
    monkeypatch.setenv("COLUMNS", "300")
    assert narrow == command_reference()
