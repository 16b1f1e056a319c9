"""`pipesched train` end to end in a subprocess: tiny config, 2 steps, every output written;
its refusals in-process (nothing starts before them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.cli_helpers import call_cli, run_cli

TINY = ["--stages", "2", "--microbatches", "2", "--steps", "2", "--batch-size", "4",
        "--blocks", "2", "--width", "16", "--seq-len", "8"]


@pytest.mark.multiprocess
def test_train_writes_timeline_trace_loss_and_summary(tmp_path: Path) -> None:
    done = run_cli("train", *TINY, "--out", str(tmp_path), timeout=240)
    assert done.returncode == 0, done.stderr
    assert "balanced partition: 4 layers into 2 stages" in done.stdout
    assert "step 2/2" in done.stdout
    assert "simulated from measured op costs" in done.stdout
    for name in ("timeline.png", "loss.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert trace["traceEvents"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary["losses"]) == 2 and summary["boundaries"][0] == 0
    assert summary["boundaries"][-1] == 4
    assert 0 <= summary["measured"]["bubble_rate"] < 1
    assert summary["peak_activations_measured"] == [2, 1]
    # bytes too (they were 0.0 on every rank): the peak count times the stage's profiled
    # activation bytes, the same per activation measured and simulated
    for measured, simulated in zip(summary["measured"]["ranks"],
                                   summary["simulated_from_measured_costs"]["ranks"]):
        assert measured["peak_activation_bytes"] > 0
        per_activation = measured["peak_activation_bytes"] / measured["peak_activations"]
        assert simulated["peak_activation_bytes"] == pytest.approx(
            simulated["peak_activations"] * per_activation)


@pytest.mark.parametrize(("args", "message"), [
    (["--schedule", "nope"], "invalid choice"),
    (["--batch-size", "5"], "must split into"),
    (["--stages", "8"], "cannot fill 8 stages"),
    (["--schedule", "1f1b", "--chunks", "2"], "takes chunks in 1"),
    (["--partition", "fastest"], "fastest"),
    (["--out", "/proc/forbidden/out"], "--out /proc/forbidden/out: cannot create"),
])
def test_train_refuses_bad_input_before_starting(tmp_path: Path, args: list[str],
                                                 message: str) -> None:
    out = [] if "--out" in args else ["--out", str(tmp_path)]
    done = call_cli("train", *TINY, *args, *out)
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr
    assert "training" not in done.stdout


def test_train_refuses_unwritable_out(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    done = call_cli("train", *TINY, "--out", str(blocker / "sub"))
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1
