"""`pipesched simulate --params-bytes`: memory per rank predicted next to the figures."""

from __future__ import annotations

import json

import pytest

from pipeline.cli import main

__all__: list[str] = []

ARGS = ["simulate", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8",
        "--activation-bytes", "1000", "--params-bytes", "4000"]


def test_json_carries_memory_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS, "--data-parallel", "2", "--zero-stage", "1", "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert [r["activations"] for r in memory] == [4000.0, 3000.0, 2000.0, 1000.0]
    # ZeRO-1 over 2 (Megatron's distributed optimizer): one gradient buffer; Adam's
    # moments of half the parameters (the fp32 master is a view of them)
    assert {(r["params"], r["gradients"], r["optimizer"]) for r in memory} == \
        {(4000.0, 4000.0, 4000.0)}


def test_table_only_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(ARGS) == 0
    assert "predicted memory per rank" in capsys.readouterr().out
    assert main(ARGS[:-2]) == 0
    assert "predicted memory" not in capsys.readouterr().out
