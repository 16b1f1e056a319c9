"""A save never writes through a name planted in the checkpoint root: a symlink (or a hard
link) under the lock's name, a temporary file's name or a step directory's name leaves its
target untouched, and `latest` stays a plain file."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pipeline.checkpoint import atomic_files, save
from pipeline.checkpoint.load import load_checkpoint
from pipeline.checkpoint.manifest import LATEST
from pipeline.checkpoint.root_lock import LOCK_NAME, release_root
from pipeline.checkpoint.staging import StagingDirectory
from pipeline.errors import CheckpointError
from pipeline.supervision.faults import FaultPoints
from tests.support.checkpoint_cases import Job

_PRECIOUS = b"export PATH=/usr/bin  # the user's own file\n"


@pytest.fixture
def victim(tmp_path: Path) -> Iterator[Path]:
    """A file outside the checkpoint root that no save may change."""
    path = tmp_path / "bashrc"
    path.write_bytes(_PRECIOUS)
    yield path
    assert path.read_bytes() == _PRECIOUS, "a save wrote through a planted name"


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "ckpt"
    path.mkdir()
    yield path
    release_root(str(path))


def _save(root: Path, job: Job) -> None:
    save.save_checkpoint(str(root), job.parts())


@pytest.mark.parametrize("link", [os.symlink, os.link], ids=["symlink", "hard link"])
def test_a_link_planted_as_the_lock_is_refused_not_written(root: Path, victim: Path,
                                                           link: object) -> None:
    # regression: `ln -s ~/.bashrc CK/.pipesched.lock` made a save write "<pid> <host>" there
    assert callable(link)
    link(str(victim), str(root / LOCK_NAME))
    with pytest.raises(CheckpointError, match="lock file"):
        _save(root, Job())
    assert not (root / LATEST).exists()


def test_a_symlink_planted_as_the_temporary_latest_is_never_written(
        root: Path, victim: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # regression: `ln -s ~/.bashrc CK/.latest.tmp-<pid>` between two saves made the next save
    # write "step_00000N" into the target and turn `latest` into a symlink
    job = Job()
    _save(root, job)
    os.symlink(victim, root / f".{LATEST}.tmp-{os.getpid()}")  # the name the old code used
    job.train(1)
    _save(root, job)
    assert not (root / LATEST).is_symlink() and (root / LATEST).read_text() == "step_000001\n"
    # an attacker who guesses the random name too: the save fails, `latest` is unchanged
    monkeypatch.setattr(atomic_files, "temporary_name", lambda name: f".{name}.guessed")
    os.symlink(victim, root / f".{LATEST}.guessed")
    job.train(1)
    with pytest.raises(CheckpointError):
        _save(root, job)
    assert not (root / LATEST).is_symlink() and (root / LATEST).read_text() == "step_000001\n"


def test_symlinks_planted_as_step_directories_leave_their_targets_untouched(
        root: Path, victim: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_bytes(_PRECIOUS)
    job = Job()
    job.train(1)
    os.symlink(elsewhere, root / "step_000001")  # the step directory this save replaces
    _save(root, job)
    assert not (root / "step_000001").is_symlink()
    assert sorted(os.listdir(elsewhere)) == ["keep.txt"]
    # the staging directory's name guessed and planted: the save fails before writing
    monkeypatch.setattr(save.secrets, "token_hex", lambda size: "deadbeef")
    os.symlink(elsewhere, root / "step_000002.partial-deadbeef")
    job.train(1)
    with pytest.raises(CheckpointError, match="cannot create"):
        _save(root, job)
    assert sorted(os.listdir(elsewhere)) == ["keep.txt"]
    assert (elsewhere / "keep.txt").read_bytes() == _PRECIOUS
    assert load_checkpoint(str(root), Job(base_seed=3).parts()).step == 1


def _tree(path: Path) -> dict[str, bytes]:
    return {str(item.relative_to(path)): item.read_bytes()
            for item in sorted(path.rglob("*")) if item.is_file()}


def _swap_staging_for(root: Path, target: Path, parked: Path) -> Callable[[], None]:
    """A fault action: move the save's fresh staging directory to `parked` and put a symlink
    to `target` under its name (what a process with write access to the root can do)."""
    def swap() -> None:
        (staging,) = root.glob("step_*.partial-*")
        os.rename(staging, parked)
        os.symlink(target, staging)
    return swap


@pytest.mark.parametrize("point", ["checkpoint.staging", "checkpoint.file",
                                   "checkpoint.commit"])
def test_a_staging_directory_swapped_for_a_symlink_never_redirects_the_save(
        root: Path, tmp_path: Path, point: str) -> None:
    # regression: swapping step_N.partial-<token> for a symlink right after the save made it
    # made the save write every file (manifest.json and weights included) into the target,
    # report success, and `verify-checkpoint` pass there
    job = Job()
    job.train(1)
    _save(root, job)
    target = tmp_path / "other_checkpoint"  # a complete checkpoint outside the root
    shutil.copytree(root / "step_000001", target)
    before = _tree(target)
    parked = root / "parked"  # still inside the root: writes may land only here
    job.train(1)
    parts = job.parts()
    parts.faults = FaultPoints()
    parts.faults.arm(point, _swap_staging_for(root, target, parked))
    with pytest.raises(CheckpointError, match="replaced"):
        save.save_checkpoint(str(root), parts)
    assert _tree(target) == before, "the save wrote through the swapped-in symlink"
    assert (root / LATEST).read_text() == "step_000001\n"
    assert not (root / "step_000002").exists()
    assert not list(root.glob("step_*.partial-*")), "the planted symlink was left behind"
    assert load_checkpoint(str(root), Job(base_seed=3).parts()).step == 1


def test_a_symlinked_root_is_refused_by_name(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    try:
        with pytest.raises(CheckpointError, match=r"root .*link is a symlink; pass the "
                                                  r"directory it points to"):
            _save(tmp_path / "link", Job())
    finally:
        release_root(str(tmp_path / "link"))
    assert not list(real.glob("step_*"))


def test_a_swap_between_the_commits_check_and_its_rename_is_undone(
        root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the race a check on a name cannot close: the swap lands right after the check; the
    # rename then moves the symlink, and the save must notice, undo and refuse
    job = Job()
    job.train(1)
    _save(root, job)
    target = tmp_path / "other_checkpoint"
    shutil.copytree(root / "step_000001", target)
    before = _tree(target)
    swap = _swap_staging_for(root, target, root / "parked")
    checked = StagingDirectory.check_named
    calls: list[str] = []

    def check_then_swap(self: StagingDirectory, name: str) -> None:
        checked(self, name)
        if not calls:
            calls.append(name)
            swap()

    monkeypatch.setattr(StagingDirectory, "check_named", check_then_swap)
    job.train(1)
    with pytest.raises(CheckpointError, match="replaced"):
        _save(root, job)
    assert calls and _tree(target) == before
    assert (root / LATEST).read_text() == "step_000001\n"
    assert not (root / "step_000002").exists() and not list(root.glob("step_*.partial-*"))
