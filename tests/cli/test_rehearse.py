"""`pipesched rehearse`: bad input is one line before any process starts; a tiny run end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.cli import main
from tests.support.cli_helpers import run_cli

__all__: list[str] = []

LAYER = {"forward": 0.002, "backward": 0.002, "params": 4096, "activation": 1024}


def _costs(tmp_path: Path, layers: list[dict[str, object]]) -> str:
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"layers": layers}))
    return str(path)


@pytest.mark.parametrize(("layers", "args", "message"), [
    (None, [], "cannot read the file"),
    ([{**LAYER, "forward": -0.001}], [], "forward=-0.001"),
    ([LAYER] * 3, ["--stages", "4"], "cannot split 3 layers into 4"),
    ([LAYER] * 4, ["--schedule", "zb-v", "--stages", "4"], "cannot split 4 layers into 8"),
    ([LAYER] * 4, ["--stages", "1"], "at least 2 pipeline ranks"),
    ([LAYER] * 4, ["--zero-stage", "1"], "--data-parallel 2"),
])
def test_bad_input_is_one_line_before_any_rank_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], layers: list[dict[str, object]] | None,
        args: list[str], message: str) -> None:
    costs = str(tmp_path / "missing.json") if layers is None else _costs(tmp_path, layers)
    argv = ["rehearse", "--costs", costs, "--schedule", "1f1b", "--stages", "2",
            "--microbatches", "2", "--out", str(tmp_path / "out"), *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1, err
    assert "rehearsing" not in err


@pytest.mark.multiprocess
@pytest.mark.slow
def test_tiny_rehearsal_writes_plot_trace_and_memory(tmp_path: Path) -> None:
    costs = _costs(tmp_path, [LAYER] * 4)
    done = run_cli("rehearse", "--costs", costs, "--schedule", "zb-h1", "--stages", "2",
                   "--microbatches", "2", "--steps", "1", "--out", str(tmp_path), timeout=240)
    assert done.returncode == 0, done.stderr
    assert "simulated + machine" in done.stdout
    assert (tmp_path / "rehearsal.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "exposed_reduction" not in summary  # d = 1: nothing to reduce
    assert [t["name"] for t in summary["timelines"]] == ["simulated", "simulated + machine",
                                                         "measured"]
    predicted, measured = summary["memory"]["predicted"], summary["memory"]["measured"]
    # sizes are exact (no timing): params, grads, Adam's two moments, saved outputs
    for p, m in zip(predicted, measured):
        assert m["params"] == p["params"] == 2 * 4096
        assert m["gradients"] == p["gradients"]
        assert m["activations"] == p["activations"]
        assert m["peak_in_flight"] == p["peak_in_flight"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_zero_one_memory_is_predicted_as_the_engine_holds_it(tmp_path: Path) -> None:
    costs = _costs(tmp_path, [LAYER] * 4)
    done = run_cli("rehearse", "--costs", costs, "--schedule", "1f1b", "--stages", "2",
                   "--data-parallel", "2", "--zero-stage", "1", "--microbatches", "2",
                   "--steps", "1", "--json", "--out", str(tmp_path), timeout=240)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    memory = summary["memory"]
    # the reduction is simulated next to the measured one, per pipeline rank (timing: only
    # that both are there; their figures are in benchmarks/bench_memory.py --section overlap)
    exposed = summary["exposed_reduction"]
    assert len(exposed["measured"]) == len(exposed["simulated"]) == 2
    assert min(exposed["measured"] + exposed["simulated"]) >= 0
    for p, m in zip(memory["predicted"], memory["measured"]):
        # Megatron's distributed optimizer: one gradient buffer, Adam on a half shard
        assert m["gradients"] == p["gradients"] == 2 * 4096
        assert m["activations"] == p["activations"]
        assert m["optimizer"] == pytest.approx(p["optimizer"], rel=0.01)  # + Adam's step
