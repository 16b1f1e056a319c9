"""A save's staging directory, held open by descriptor so that a swapped name cannot redirect it.

Why descriptors and not checks on paths. Anyone who can write into the checkpoint root can
replace ``root/step_N.partial-<token>`` by a symlink between two system calls of the save;
a path checked and then used would follow it, and the save would write its weights and
manifest into the symlink's target (and `verify-checkpoint` would pass there). So the root
and the staging directory are opened once with ``O_DIRECTORY | O_NOFOLLOW`` (a symlink is
refused with ELOOP) and every open, rename, fsync and mkdir of the save goes through those
descriptors (``dir_fd=``). The commit renames the name, not the descriptor, so it checks
before and after the rename that the name still is the directory it holds open.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.checkpoint.atomic_files import open_directory, remove_quietly
from pipeline.errors import CheckpointError

__all__ = ["StagingDirectory", "create_staging", "join_staging", "open_root"]


def open_root(root: str) -> int:
    """A descriptor of the checkpoint root; `CheckpointError` if it is a symlink or no
    directory (the save would not know where it writes)."""
    try:
        return open_directory(root)
    except OSError as error:
        if error.errno == errno.ELOOP or os.path.islink(root):  # Linux says ENOTDIR
            raise CheckpointError(
                f"checkpoint root {root} is a symlink; pass the directory it points to "
                f"({os.path.realpath(root)}): a save writes only through names it created",
                path=root) from None
        raise CheckpointError(f"cannot open the checkpoint root {root}: {error.strerror}",
                              path=root) from None


@dataclass
class StagingDirectory:
    """The open root and staging directory of one save (close both with `close`)."""

    root: str
    name: str
    """The staging directory's name inside the root."""
    root_fd: int
    fd: int

    @property
    def path(self) -> str:
        return os.path.join(self.root, self.name)

    def close(self) -> None:
        for descriptor in (self.fd, self.root_fd):
            try:
                os.close(descriptor)
            except OSError:
                pass

    def exists(self, name: str) -> bool:
        """Whether anything (a symlink included, not followed) has `name` in the root."""
        try:
            os.stat(name, dir_fd=self.root_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def rename(self, source: str, target: str) -> None:
        """Rename inside the root (names, through the root's descriptor)."""
        os.rename(source, target, src_dir_fd=self.root_fd, dst_dir_fd=self.root_fd)

    def holds(self, name: str) -> bool:
        """Whether `name` in the root is this staging directory itself (not a symlink, not
        another directory put under its name)."""
        try:
            named = os.stat(name, dir_fd=self.root_fd, follow_symlinks=False)
        except OSError:
            return False
        mine = os.fstat(self.fd)
        return (named.st_dev, named.st_ino) == (mine.st_dev, mine.st_ino)

    def check_named(self, name: str) -> None:
        """`CheckpointError` unless `name` in the root still is this directory."""
        if not self.holds(name):
            raise CheckpointError(
                f"{os.path.join(self.root, name)} is no longer the staging directory this save "
                "created (it was replaced, e.g. by a symlink): another process writes into "
                f"{self.root}; make the root writable only by this job", path=self.path)

    def remove(self) -> None:
        """Remove the staging directory's name: a symlink itself, a directory with its files
        (never through a symlink)."""
        try:
            mode = os.stat(self.name, dir_fd=self.root_fd, follow_symlinks=False).st_mode
        except OSError:
            return
        if not stat.S_ISDIR(mode):
            remove_quietly(self.name, dir_fd=self.root_fd)
        else:
            shutil.rmtree(self.name, dir_fd=self.root_fd, ignore_errors=True)

    def fsync_root(self) -> None:
        os.fsync(self.root_fd)


def create_staging(root: str, name: str, reach: Callable[[str], None]) -> StagingDirectory:
    """Rank 0: make the fresh directory `name` in `root` and open it (OSError, or
    `CheckpointError` if its name was swapped before it could be opened)."""
    root_fd = open_root(root)
    try:
        os.mkdir(name, dir_fd=root_fd)  # fresh: a name planted there (a symlink) fails
        reach("checkpoint.staging")
        fd = _open_staging(root, name, root_fd)
    except CheckpointError:
        remove_quietly(name, dir_fd=root_fd)  # what was swapped in: unlinked, not followed
        os.close(root_fd)
        raise
    except BaseException:
        os.close(root_fd)
        raise
    staging = StagingDirectory(root, name, root_fd, fd)
    if os.listdir(fd):  # another directory renamed under the fresh name
        staging.close()
        raise CheckpointError(f"{staging.path} is not the empty directory this save just "
                              "created; another process writes into the root", path=root)
    return staging


def join_staging(root: str, name: str) -> StagingDirectory:
    """Another rank: open the staging directory rank 0 named (made here when the root is
    not shared between hosts)."""
    os.makedirs(root, exist_ok=True)
    root_fd = open_root(root)
    try:
        try:
            os.mkdir(name, dir_fd=root_fd)
        except FileExistsError:
            pass
        fd = _open_staging(root, name, root_fd)
    except BaseException:
        os.close(root_fd)
        raise
    return StagingDirectory(root, name, root_fd, fd)


def _open_staging(root: str, name: str, root_fd: int) -> int:
    try:
        return open_directory(name, dir_fd=root_fd)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR):
            raise CheckpointError(
                f"{os.path.join(root, name)} was replaced right after this save created it "
                f"(by a symlink or a file: {error.strerror}); nothing was written through "
                f"it. Another process writes into {root}: make the root writable only by "
                "this job", path=os.path.join(root, name)) from None
        raise
