"""Every planted bug of `tests/support/planted_bugs.py` still edits its file: the text it
replaces occurs exactly once there, and each test it names exists. Refactors move code, and a
planted bug whose text no longer occurs is reported as an ERROR only when someone runs the
script (one did, unnoticed, until this test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.planted_bugs import BUGS, ROOT, PlantedBug

__all__: list[str] = []


@pytest.mark.parametrize("bug", BUGS, ids=[bug.name for bug in BUGS])
def test_the_edit_applies_once_and_its_tests_exist(bug: PlantedBug) -> None:
    text = (ROOT / bug.path).read_text()
    assert text.count(bug.old) == 1, f"{bug.name}: its text occurs {text.count(bug.old)} " \
                                     f"times in {bug.path}; update the planted bug"
    assert bug.new != bug.old
    for test in bug.tests:
        assert Path(ROOT / test.split("::")[0]).is_file(), f"{bug.name}: no {test}"


def test_a_stale_edit_is_caught() -> None:
    """Planted: the dataflow bug's text before `dataflow.execute` was rewritten."""
    stale = PlantedBug("stale", "schedules/analysis/dataflow.py",
                       "                    if dep > ready:\n                        ready = dep\n"
                       "                end = ready + forward[s]", "", ())
    assert (ROOT / stale.path).read_text().count(stale.old) != 1
