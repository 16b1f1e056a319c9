"""One writing job per checkpoint root: an exclusive `flock` the kernel drops when its holder dies.

Why a lock and not only safer names. Two jobs saving into one root (a restarted job next to
orphans of the previous one) break each other in more ways than the sweep that deleted the
other job's staging directory: they also flip `latest` between their steps and replace each
other's step directories. Names alone can make the sweep spare a live writer, but not make
two writers' `latest` mean anything. So the first job to save takes the root, and a second
writer is refused at once with `CheckpointRootLockedError` naming the root and the holder.

Why `flock` (BSD locks) and not `fcntl.lockf` (POSIX record locks) or a pid file:
- a pid file needs the next writer to decide whether its pid is stale (pids are reused, the
  holder may run on another host); a kernel lock is released by the kernel when the holding
  process dies by any means, SIGKILL and the OOM killer included, so there is nothing stale;
- POSIX locks belong to the process and are dropped when *any* descriptor of the file is
  closed in it (one stray `open(...).close()` of the lock file frees the root); a `flock`
  belongs to its open file description, so only closing our own descriptor frees it.
The lock is held from the job's first save until the process exits (or `release_root`):
saves are what a second writer must not interleave with, and a job saves again and again.
Only rank 0 takes it: rank 0 names the staging directory, commits and sweeps; the other
ranks write only into the staging directory rank 0 named for them.

Limits: `flock` is local to a host on most network file systems unless they forward it (NFS
v4 maps it to a byte-range lock, Lustre needs ``-o flock``); where the file system has no
locks at all the save fails with the kernel's error (ENOLCK) rather than running unguarded.
"""

from __future__ import annotations

import fcntl
import os
import socket
import stat

from pipeline.errors import CheckpointError

__all__ = ["LOCK_NAME", "CheckpointRootLockedError", "held_roots", "lock_root", "release_root"]

LOCK_NAME = ".pipesched.lock"
"""The lock file inside a checkpoint root; it holds the holder's "<pid> <host>"."""

_held: dict[str, int] = {}  # real path of a root -> the descriptor holding its lock


class CheckpointRootLockedError(CheckpointError):
    """Another process holds the checkpoint root: it is saving there (or did and still runs).

    `root` is the checkpoint root, `holder_pid` and `holder_host` the process holding it as
    it recorded itself (None when it had not written them yet).
    """

    def __init__(self, message: str, *, root: str, holder_pid: int | None,
                 holder_host: str | None) -> None:
        self.root = root
        self.holder_pid = holder_pid
        self.holder_host = holder_host
        super().__init__(message, path=os.path.join(root, LOCK_NAME))

    def __reduce__(self) -> tuple[object, ...]:  # keep the fields across pickling (agree)
        return (_rebuild, (str(self), self.root, self.holder_pid, self.holder_host))


def _rebuild(message: str, root: str, pid: int | None, host: str | None
             ) -> CheckpointRootLockedError:
    return CheckpointRootLockedError(message, root=root, holder_pid=pid, holder_host=host)


def _release_in_child() -> None:
    # A forked child (a DataLoader worker) shares the lock's open file description; closing
    # its copy lets the lock go when the parent dies, whatever the child does.
    for descriptor in _held.values():
        os.close(descriptor)
    _held.clear()


os.register_at_fork(after_in_child=_release_in_child)


def held_roots() -> list[str]:
    """Real paths of the roots this process holds."""
    return sorted(_held)


def lock_root(root: str) -> None:
    """Hold `root` for this process (no-op if it already does); `CheckpointRootLockedError`
    if another process holds it, `CheckpointError` if the file system cannot lock."""
    key = os.path.realpath(root)
    if key in _held:
        return
    path = os.path.join(root, LOCK_NAME)
    try:  # O_NOFOLLOW: a symlink planted under the lock's name is refused, never written
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as error:
        raise CheckpointError(f"cannot open the lock file {path}: {error}; if it is a "
                              "symlink, remove it (the lock is always a plain file)",
                              path=path) from None
    status = os.fstat(descriptor)
    if not stat.S_ISREG(status.st_mode) or status.st_nlink != 1:
        # a hard link to another file (or a FIFO) under the lock's name: its holder's pid
        # would be written into that file
        os.close(descriptor)
        raise CheckpointError(f"the lock file {path} is not a plain file with one name (a "
                              "hard link or a special file was put there); remove it and save "
                              "again", path=path)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid, host = _read_holder(descriptor)
        os.close(descriptor)
        raise CheckpointRootLockedError(_locked_message(root, pid, host), root=root,
                                        holder_pid=pid, holder_host=host) from None
    except OSError as error:
        os.close(descriptor)
        raise CheckpointError(f"cannot lock {path} ({error}); the file system does not "
                              "support flock: save to a local or flock-capable directory",
                              path=path) from None
    _held[key] = descriptor
    try:  # informative only: who to look for; a full disk must not fail the save here
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    except OSError:
        pass


def release_root(root: str) -> None:
    """Let `root` go (a later save takes it again); no-op if this process does not hold it."""
    descriptor = _held.pop(os.path.realpath(root), None)
    if descriptor is not None:
        os.close(descriptor)  # closing the only descriptor drops the flock


def _read_holder(descriptor: int) -> tuple[int | None, str | None]:
    try:
        words = os.pread(descriptor, 512, 0).decode("utf-8", "replace").split()
    except OSError:
        return None, None
    pid = int(words[0]) if words and words[0].isdigit() else None
    return pid, (words[1] if len(words) > 1 else None)


def _locked_message(root: str, pid: int | None, host: str | None) -> str:
    if pid is None:
        holder = "another process (it has not recorded its pid yet)"
    else:
        holder = f"process {pid} on host {host or '?'}"
        if host == socket.gethostname() and not _alive(pid):
            holder += " (gone now: a process it forked still holds the lock file open)"
    return (f"checkpoint root {root} is held by {holder}: another job is saving there (an "
            "earlier launch still running?). Stop that job, or save this one to another "
            "directory")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
