"""The tier rules of tests/conftest.py: tests/tiers.txt parses, the longest entry wins, unlisted
multi-process tests go to the full tier, and a named node id selects regardless of tier."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tiers import (
    TierList,
    default_tier,
    named_on_command_line,
    read_tier_list,
    tier_of,
)

_LIST = TierList({"tests/a": "full", "tests/a/test_x.py::test_one": "fast",
                  "tests/a/test_x.py::test_two[p1]": "fast"})


def test_the_checked_in_list_parses_and_names_test_files() -> None:
    entries = read_tier_list().entries
    assert entries, "tests/tiers.txt lists no test"
    root = Path(__file__).resolve().parents[1]
    missing = [nodeid for nodeid in entries if not (root / nodeid.split("::")[0]).exists()]
    assert not missing, f"tests/tiers.txt names files that do not exist: {missing}"


@pytest.mark.parametrize(("nodeid", "expected"), [
    ("tests/a/test_x.py::test_one", ("tests/a/test_x.py::test_one", "fast")),
    ("tests/a/test_x.py::test_one[3-4]", ("tests/a/test_x.py::test_one", "fast")),
    ("tests/a/test_x.py::test_two[p1]", ("tests/a/test_x.py::test_two[p1]", "fast")),
    ("tests/a/test_x.py::test_two[p10]", ("tests/a", "full")),   # not a prefix at a boundary
    ("tests/a/test_x.py::test_one_more", ("tests/a", "full")),
    ("tests/ab/test_y.py::test_z", None),
])
def test_the_longest_entry_ending_at_a_boundary_wins(nodeid: str,
                                                    expected: tuple[str, str] | None) -> None:
    assert _LIST.lookup(nodeid) == expected


def test_a_marker_wins_over_the_list_and_the_list_over_the_rule() -> None:
    assert tier_of({"multiprocess"}, "fast", "tests/a/test_x.py::test_three", _LIST) == "fast"
    assert tier_of(set(), "full", "tests/a/test_x.py::test_one", _LIST) == "full"
    assert tier_of({"multiprocess"}, None, "tests/a/test_x.py::test_one", _LIST) == "fast"
    assert tier_of(set(), None, "tests/b/test_y.py::test_z", _LIST) == "fast"
    assert [default_tier({k}) for k in ("multiprocess", "slow", "cuda", "hypothesis")] == \
        ["full", "full", "full", "fast"]


@pytest.mark.parametrize("line", ["quick tests/a.py", "fast", "full a.py::test_b"])
def test_a_bad_line_is_refused_with_its_number(tmp_path: Path, line: str) -> None:
    path = tmp_path / "tiers.txt"
    path.write_text(f"# comment\n\n{line}\n")
    with pytest.raises(ValueError, match=r"tiers\.txt:3: "):
        read_tier_list(path)


def test_an_entry_listed_twice_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "tiers.txt"
    path.write_text("fast tests/a.py  # one\nfull tests/a.py  # two\n")
    with pytest.raises(ValueError, match="listed twice"):
        read_tier_list(path)


def test_command_line_arguments_select_their_own_tests(tmp_path: Path) -> None:
    file = tmp_path / "tests" / "test_x.py"
    named = [(tmp_path / "tests", ""), (file, "test_one"), (file, "test_two[a]"),
             (tmp_path / "other", "")]
    assert named_on_command_line("tests/test_x.py::test_one[1]", file, named) == [0, 1]
    assert named_on_command_line("tests/test_x.py::test_two[a]", file, named) == [0, 2]
    assert named_on_command_line("tests/test_x.py::test_three", file, named) == [0]
