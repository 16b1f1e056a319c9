"""One line for every failure of `pipesched train`, and a pipe is not a fault: a closed
stdout, a user's `--model` that raises or does not compile, a forward-only schedule and
absurd --seed / --timeout values each end in one line (the user's traceback in
failure.txt), never a Python traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.cli import build_parser, main
from tests.support.cli_helpers import REPO

TINY = ["--stages", "2", "--microbatches", "2", "--steps", "2", "--batch-size", "4",
        "--blocks", "2", "--width", "16", "--seq-len", "8"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_train_piped_into_head_survives_the_closed_stdout(tmp_path: Path) -> None:
    # regression: `pipesched train ... | head -1` ended "rank 0 failed: BrokenPipeError", exit 3
    command = (f"{sys.executable} -m pipeline.cli train {' '.join(TINY)} --out {tmp_path} "
               "| head -c 1; exit ${PIPESTATUS[0]}")
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr


@pytest.mark.parametrize(("source", "name", "line", "exception"), [
    ("import torch\n\n\ndef build():\n    raise RuntimeError('no data here')\n", "build", 5,
     "RuntimeError"),
    ("def build(:\n    pass\n", "build", 1, "SyntaxError"),
    ("def build():\n    return 1\n", "make_model", None, None),
    ("def build(size):\n    return size\n", "build", None, "TypeError"),
])
def test_a_user_model_that_raises_is_one_line_naming_file_line_and_exception(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], source: str, name: str,
        line: int | None, exception: str | None) -> None:
    # regression: each printed a traceback with exit 1 (documented as "a pipesched bug")
    model = tmp_path / "my_model.py"
    model.write_text(source)
    out = tmp_path / "out"
    code = main(["train", *TINY, "--model", f"{model}:{name}", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and str(model) in err
    if exception is None:  # a wrong name lists what is there
        assert "has no function 'make_model'; callables there: build" in err
        return
    assert exception in err
    if line is not None:
        assert f"{model}:{line}" in err
    assert "failure.txt" in err and "Traceback" in (out / "failure.txt").read_text()


def test_train_refuses_a_forward_only_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    # regression: "internal error: the step ended holding {'saved': 2}"
    assert main(["train", *TINY, "--schedule", "forward-only"]) == 2
    assert "runs forwards only" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--seed", str(-10**30), "a seed must be in"),  # "Overflow when unpacking long long"
    ("--timeout", "1e-9", "must be at least 1 second"),  # accepted, then blamed a rank
])
def test_train_refuses_absurd_seed_and_timeout_when_parsed(
        capsys: pytest.CaptureFixture[str], flag: str, value: str, message: str) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser("train").parse_args(["train", flag, value])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
