"""Output paths are checked up front: suffix, directory, permission; nothing left behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from viz import FIGURE_FORMATS, OutputPathError, check_output_path


def test_a_new_writable_path_passes_and_leaves_no_file(tmp_path: Path) -> None:
    assert check_output_path(tmp_path / "a.PNG", FIGURE_FORMATS) == tmp_path / "a.PNG"
    assert list(tmp_path.iterdir()) == []


def test_an_existing_file_is_kept_as_it_was(tmp_path: Path) -> None:
    existing = tmp_path / "a.svg"
    existing.write_text("keep me")
    check_output_path(existing, FIGURE_FORMATS)
    assert existing.read_text() == "keep me"


@pytest.mark.parametrize(("name", "message"), [
    ("missing/a.png", "directory .* does not exist"),
    (".", "it is a directory"),
    ("a.pdf", r"'\.pdf' is not a format we write; end the file name with one of \.png, \.svg"),
    ("a", "no suffix"),
])
def test_bad_paths_are_refused_with_the_fix(tmp_path: Path, name: str, message: str) -> None:
    with pytest.raises(OutputPathError, match=message):
        check_output_path(tmp_path / name, FIGURE_FORMATS)


def test_a_directory_we_cannot_write_is_refused(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    target = locked / "a.png"
    if os.access(locked, os.W_OK):  # root ignores permission bits: use a read-only mount
        target = Path("/sys/pipesched-test.png")
        if not Path("/sys").is_dir() or (os.access("/sys", os.W_OK) and _can_create(target)):
            pytest.skip("no directory here refuses writes")
    with pytest.raises(OutputPathError, match="cannot write"):
        check_output_path(target, FIGURE_FORMATS)


def _can_create(path: Path) -> bool:
    try:
        with open(path, "ab"):
            pass
    except OSError:
        return False
    path.unlink()
    return True
