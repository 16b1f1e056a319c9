"""`pipesched train --zero-stage 2|3`: the same losses as without ZeRO (the commands as a
user types them), and refusals before any process starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.cli_helpers import run_cli

TINY = ["--stages", "2", "--data-parallel", "2", "--microbatches", "2", "--steps", "3",
        "--batch-size", "8", "--blocks", "2", "--width", "16", "--seq-len", "8"]


def _losses(tmp_path: Path, *zero: str) -> list[float]:
    out = tmp_path / ("zero" + "".join(zero).replace("-", ""))
    done = run_cli("train", *TINY, *zero, "--out", str(out), timeout=300)
    assert done.returncode == 0, done.stderr
    losses: list[float] = json.loads((out / "summary.json").read_text())["losses"]
    return losses


@pytest.mark.multiprocess
@pytest.mark.slow
def test_zero_2_and_3_train_the_same_losses_as_plain_data_parallel(tmp_path: Path) -> None:
    plain = _losses(tmp_path)
    for zero in (["--zero-stage", "2"], ["--zero", "3"],
                 ["--zero", "3", "--no-reshard-after-forward"]):
        assert _losses(tmp_path, *zero) == pytest.approx(plain, abs=1e-5), zero


@pytest.mark.parametrize(("args", "message"), [
    (["--zero-stage", "4"], "invalid choice"),
    (["--no-reshard-after-forward"], "add --zero-stage 3"),
])
def test_train_refuses_what_zero_cannot_run(tmp_path: Path, args: list[str],
                                            message: str) -> None:
    done = run_cli("train", *TINY, *args, "--out", str(tmp_path), timeout=120)
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr
