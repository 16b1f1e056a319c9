"""Crash-safe file writes: temporary name, fsync, rename, fsync the directory.

POSIX `rename` replaces a name atomically, but only the directory's fsync makes the rename
itself durable; without the file's fsync a power loss can leave the new name pointing at
zero-filled blocks. So every write is: bytes to ``.<name>.tmp-<pid>-<random>``, fsync the
file, rename over `name`, fsync the directory (the sequence SQLite and etcd use).

Never through a planted name: the temporary file is created with
``O_CREAT | O_EXCL | O_NOFOLLOW``, so a symlink (or any file) already under that name makes
the write fail rather than write into what it points at, and the rename replaces the name
`path` itself (a symlink there is replaced, its target untouched).

Never through a swapped directory either: with `dir_fd` (a descriptor of the directory,
opened with ``O_DIRECTORY | O_NOFOLLOW`` by `open_directory`) every open, rename and fsync
is relative to that descriptor, so replacing the directory's name by a symlink after it was
opened changes nothing a write reaches (a check on a path would not survive that race).
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Callable

from pipeline.files import UnreadableInputError, open_regular_file, read_regular_file

__all__ = ["CREATE_FLAGS", "DIRECTORY_FLAGS", "atomic_write", "fsync_directory", "open_directory",
           "read_pointer", "read_pointer_lines", "remove_quietly", "sha256_bytes", "sha256_file",
           "temporary_name", "write_lines"]

CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
"""How every file pipesched writes is created: a new file, never an existing name or the
target of a symlink planted under that name."""

DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
"""How a directory a save writes into is opened: the directory itself, never a symlink's
target (ELOOP) nor a file (ENOTDIR)."""

_CHUNK = 1 << 20


def open_directory(name: str, *, dir_fd: int | None = None) -> int:
    """A descriptor of the directory `name` (relative to `dir_fd` if given), refusing a
    symlink under that name with OSError (ELOOP)."""
    return os.open(name, DIRECTORY_FLAGS, dir_fd=dir_fd)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str, limit: int) -> str:
    """Hex sha256 of a regular file of at most `limit` bytes, read in 1 MiB chunks (checkpoint
    files can be large); `UnreadableInputError` for anything else (a FIFO would block, a
    device never end), without blocking."""
    digest = hashlib.sha256()
    with open_regular_file(path) as handle:
        remaining = limit + 1
        while remaining and (chunk := handle.read(min(_CHUNK, remaining))):
            digest.update(chunk)
            remaining -= len(chunk)
    if not remaining:
        raise UnreadableInputError(f"{path} is over {limit:,} bytes, more than its manifest "
                                   "records: the file was replaced")
    return digest.hexdigest()


def fsync_directory(path: str) -> None:
    """Make the names in `path` (renames, new files) durable."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def atomic_write(path: str, data: bytes, *, dir_fd: int | None = None,
                 before_rename: Callable[[], None] | None = None) -> None:
    """Write `data` to `path` so that a crash leaves the old file or the new one, never a mix.

    With `dir_fd`, `path` is a bare name inside the directory `dir_fd` holds open, and every
    step goes through that descriptor. `before_rename` is called after the bytes are durable
    under the temporary name and before the rename (where a crash leaves a stray temporary
    file): a fault point's hook. A failed write or rename (ENOSPC, EIO) removes the temporary
    file before raising: a full disk must not keep what it could not finish.
    """
    directory, name = os.path.split(path)
    if dir_fd is not None and directory:
        raise ValueError(f"with dir_fd, write a bare name, not {path!r}")
    temporary = os.path.join(directory, temporary_name(name))
    try:
        _write_durably(temporary, data, dir_fd)
    except OSError:
        remove_quietly(temporary, dir_fd=dir_fd)
        raise
    if before_rename is not None:
        before_rename()
    try:
        os.replace(temporary, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError:
        remove_quietly(temporary, dir_fd=dir_fd)
        raise
    if dir_fd is None:
        fsync_directory(directory or ".")
    else:
        os.fsync(dir_fd)


def temporary_name(name: str) -> str:
    """A fresh hidden name beside `name` (pid and random: not guessable, never reused)."""
    return f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"


def _write_durably(path: str, data: bytes, dir_fd: int | None = None) -> None:
    """`data` into a new file `path`, on disk when this returns (tests fill the disk here);
    `FileExistsError` if anything, a symlink included, is already named `path`."""
    with os.fdopen(os.open(path, CREATE_FLAGS, 0o644, dir_fd=dir_fd), "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def remove_quietly(path: str, *, dir_fd: int | None = None) -> None:
    """Remove a file if it is there; a failure to remove it is not worth another error."""
    try:
        os.remove(path, dir_fd=dir_fd)
    except OSError:
        pass


def write_lines(path: str, lines: list[str], *, dir_fd: int | None = None) -> None:
    """Atomically make the small text file `path` hold `lines` (the `latest` pointer)."""
    atomic_write(path, "".join(line + "\n" for line in lines).encode(), dir_fd=dir_fd)


def read_pointer_lines(path: str) -> list[str]:
    """The lines of a pointer file; OSError/UnicodeError if unreadable, and
    `UnreadableInputError` (a ValueError) if not a small regular file (a FIFO would block)."""
    return read_regular_file(path, 4096).decode("utf-8").strip().splitlines()


def read_pointer(path: str) -> str:
    """The name a pointer file holds (its first line, stripped; see `read_pointer_lines`)."""
    lines = read_pointer_lines(path)
    return lines[0].strip() if lines else ""
