"""Bounded reads of input files: a regular file only, opened without blocking, size capped."""

from __future__ import annotations

import argparse
import json
import os
import stat
from typing import Any, BinaryIO

__all__ = ["InputFileType", "OutputFileType", "UnreadableInputError", "loads_json",
           "open_regular_file", "read_json_file", "read_regular_file"]


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


class InputFileType:
    """argparse type of every flag that names a file to read: checked when the command line
    is parsed, before any work starts, as the command will read it (a regular file of at most
    `limit` bytes, a JSON document when `json_document`), so a FIFO, a device, a huge or a
    deeply nested file is one line of error, never a hang or a traceback. The command reads
    it again with the same bounds. `or_text`: a value naming no file is passed on as text (a
    built-in name or an inline shape); `suffix_separator`: the file is the part before the
    last separator (``f.py:build``); `directory_file`: a directory stands for that file inside
    it (an HF model directory's ``config.json``). Returns the value unchanged."""

    def __init__(self, limit: int, *, json_document: bool = False, or_text: bool = False,
                 suffix_separator: str | None = None, directory_file: str | None = None
                 ) -> None:
        self.limit = limit
        self.json_document = json_document
        self.or_text = or_text
        self.suffix_separator = suffix_separator
        self.directory_file = directory_file
        self.__name__ = "input file"  # argparse names the type in its messages

    def __call__(self, text: str) -> str:
        path = text
        if self.suffix_separator is not None and self.suffix_separator in text:
            path = text.rsplit(self.suffix_separator, 1)[0]
        if self.or_text and not os.path.lexists(path):
            return text
        if self.directory_file is not None and os.path.isdir(path):
            path = os.path.join(path, self.directory_file)
        try:
            data = read_regular_file(path, self.limit)
            if self.json_document:
                loads_json(data, path)
        except UnreadableInputError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        except FileNotFoundError:
            return text  # the command says what it needs, as for any missing file
        except OSError as error:
            raise argparse.ArgumentTypeError(f"cannot read {path}: {error.strerror}") from None
        return text


class OutputFileType:
    """argparse type of a flag naming a file to write: refused when the name exists and is
    not a regular file (writing into a FIFO waits for a reader forever, a device swallows
    it). Returns the path."""

    __name__ = "output file"

    def __call__(self, text: str) -> Any:
        from pathlib import Path

        try:
            mode = os.stat(text).st_mode
        except OSError:
            return Path(text)  # a new file: the command creates it
        if not stat.S_ISREG(mode):
            raise argparse.ArgumentTypeError(f"{text} is {_kind(mode)}, not a regular file; "
                                             "name a new or regular file to write")
        return Path(text)
