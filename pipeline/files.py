"""Bounded reads of input files: a regular file only, opened without blocking, size capped."""

from __future__ import annotations

import json
import os
import stat
from typing import Any, BinaryIO

__all__ = ["UnreadableInputError", "loads_json", "open_regular_file", "read_json_file",
           "read_regular_file"]


class UnreadableInputError(ValueError):
    """An input path is not a regular file (a FIFO, a device, a directory), is too large,
    or does not hold what it must; the message names the path and the fix."""


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def open_regular_file(path: str | os.PathLike[str]) -> BinaryIO:
    """`path` opened for binary reading if it is a regular file: anything else is refused with
    `UnreadableInputError` before it is read (reading a FIFO waits for a writer forever,
    /dev/zero never ends). `OSError` if it cannot be opened at all."""
    shown = os.fspath(path)
    mode = os.stat(shown).st_mode  # before open: opening a FIFO for reading would block
    if not stat.S_ISREG(mode):
        raise UnreadableInputError(f"{shown} is {_kind(mode)}, not a regular file; pass the path "
                                   "of a regular file")
    # O_NONBLOCK: should it have become a FIFO since the stat, the open still returns at once
    descriptor = os.open(shown, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    mode = os.fstat(descriptor).st_mode
    if not stat.S_ISREG(mode):
        os.close(descriptor)
        raise UnreadableInputError(f"{shown} is {_kind(mode)}, not a regular file")
    return os.fdopen(descriptor, "rb")


def read_regular_file(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of `path`, at most `limit` of them (see `open_regular_file`); a file over
    `limit` bytes is refused with `UnreadableInputError`."""
    with open_regular_file(path) as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise UnreadableInputError(f"{os.fspath(path)} is over {limit:,} bytes, too large for "
                                   "what it must hold; pass the right file")
    return data


class _DuplicateKeyError(ValueError):
    pass


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's default keeps the last of two equal keys: a silent wrong value."""
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise _DuplicateKeyError(repr(key))
        document[key] = value
    return document


def read_json_file(path: str | os.PathLike[str], limit: int) -> Any:
    """The JSON document in `path` (read as `read_regular_file` does); `UnreadableInputError`
    for text that is not UTF-8 JSON or is nested too deeply to parse."""
    return loads_json(read_regular_file(path, limit), os.fspath(path))


def loads_json(data: bytes, shown: str) -> Any:
    """The JSON document in `data` (from `shown`), each key given once; `UnreadableInputError`
    for text that is not UTF-8 JSON, gives a key twice, or is nested too deeply to parse."""
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=_refuse_duplicates)
    except UnicodeDecodeError as error:
        raise UnreadableInputError(f"{shown} is not UTF-8 text (byte {error.start}); save it "
                                   "as UTF-8 JSON") from None
    except json.JSONDecodeError as error:
        raise UnreadableInputError(f"{shown} is not valid JSON at line {error.lineno} column "
                                   f"{error.colno}: {error.msg}") from None
    except _DuplicateKeyError as error:
        raise UnreadableInputError(f"{shown} gives the key {error} twice in one object; "
                                   "give each key once") from None
    except RecursionError:
        raise UnreadableInputError(f"{shown} is nested too deeply to be read as JSON") from None
    except ValueError as error:  # e.g. an integer over 4,300 digits (int_max_str_digits)
        raise UnreadableInputError(f"{shown} cannot be read as JSON: {error}") from None
