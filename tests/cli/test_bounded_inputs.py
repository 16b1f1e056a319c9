"""Input files are read bounded: a FIFO, a device or a huge file given as `latest`,
`manifest.json`, `--model` or `--cluster` is refused at once with one line, never read
until memory runs out or waited on forever."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from pipeline.files import UnreadableInputError, read_json_file, read_regular_file
from pipeline.planner.load import MAX_INPUT_BYTES
from tests.support.cli_helpers import call_cli

_SHAPE = "layers=4,hidden=64,heads=4,vocab=128,seq=32"


def _fifo(tmp_path: Path, name: str = "fifo") -> Path:
    path = tmp_path / name
    os.mkfifo(path)
    return path


def _huge(tmp_path: Path) -> Path:
    path = tmp_path / "huge.json"
    with open(path, "wb") as handle:  # sparse: costs no disk
        handle.truncate(MAX_INPUT_BYTES + 1)
    return path


def _deep(tmp_path: Path) -> Path:
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    return path


@pytest.mark.parametrize(("kind", "expected"), [
    ("fifo", "is a named pipe (FIFO), not a regular file"),
    ("device", "is a device, not a regular file"),
    ("directory", "is a directory, not a regular file"),
    ("huge", f"is over {MAX_INPUT_BYTES:,} bytes"),
])
def test_only_a_bounded_regular_file_is_read(tmp_path: Path, kind: str, expected: str) -> None:
    path = {"fifo": lambda: _fifo(tmp_path), "device": lambda: Path("/dev/zero"),
            "directory": lambda: tmp_path, "huge": lambda: _huge(tmp_path)}[kind]()
    with pytest.raises(UnreadableInputError, match=re.escape(expected)):
        read_regular_file(path, MAX_INPUT_BYTES)


def test_deep_json_is_refused_not_a_recursion_error(tmp_path: Path) -> None:
    with pytest.raises(UnreadableInputError, match="nested too deeply"):
        read_json_file(_deep(tmp_path), MAX_INPUT_BYTES)


def test_a_small_regular_file_reads_whole(tmp_path: Path) -> None:
    path = tmp_path / "ok.json"
    path.write_text('{"a": [1, 2]}')
    assert read_regular_file(path, 13) == b'{"a": [1, 2]}'
    assert read_json_file(path, 100) == {"a": [1, 2]}
    with pytest.raises(UnreadableInputError, match="over 12 bytes"):
        read_regular_file(path, 12)


@pytest.mark.parametrize("flag", ["--model", "--cluster"])
@pytest.mark.parametrize("kind", ["fifo", "device", "huge", "deep"])
def test_plan_refuses_unbounded_input_files(tmp_path: Path, flag: str, kind: str) -> None:
    # regression: /dev/zero grew to a MemoryError, a FIFO hung, deep JSON a RecursionError
    path = {"fifo": lambda: _fifo(tmp_path), "device": lambda: Path("/dev/zero"),
            "huge": lambda: _huge(tmp_path), "deep": lambda: _deep(tmp_path)}[kind]()
    model, cluster = (str(path), "a100-80g") if flag == "--model" else (_SHAPE, str(path))
    done = call_cli("plan", "--model", model, "--cluster", cluster, "--global-batch", "8")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"pipesched plan: error: argument {flag}: {path}"), \
        done.stderr  # refused as the command line is parsed (pipeline.files.InputFileType)
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1


@pytest.mark.parametrize("where", ["latest", "step_000001/manifest.json"])
def test_verify_checkpoint_refuses_a_fifo_without_blocking(tmp_path: Path, where: str) -> None:
    # regression: `mkfifo ckpt/latest; pipesched verify-checkpoint ckpt` hung in open()
    root = tmp_path / "ckpt"
    (root / "step_000001").mkdir(parents=True)
    _fifo(root, where)
    done = call_cli("verify-checkpoint",
                    str(root if where == "latest" else root / "step_000001"))
    assert done.returncode == 2, done.stderr
    assert f"{root / where} is a named pipe (FIFO)" in done.stderr, done.stderr
