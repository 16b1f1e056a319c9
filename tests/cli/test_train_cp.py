"""`pipesched train --cp`: a size the sequences cannot split into is one line before any
rank; a recipe of context-parallel layers trains at pp 2 × cp 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cli_helpers import run_cli

RECIPE = "examples/hf_tensor_parallel_recipe.py:build"


def test_a_cp_the_sequences_cannot_take_is_one_line_naming_the_fix() -> None:
    pytest.importorskip("transformers")
    result = run_cli("train", "--model", RECIPE, "--stages", "2", "--cp", "3", "--steps", "1",
                     "--batch-size", "8", "--microbatches", "2")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "training" not in result.stdout, result
    assert lines[0].startswith("pipesched train: error: context_parallel=3 cuts each sequence "
                               "into 2·cp = 6 chunks, but the sequence length 32 is not a "
                               "multiple of 6"), lines


def test_cp_on_the_demo_model_is_refused() -> None:
    result = run_cli("train", "--stages", "2", "--cp", "2", "--steps", "1")
    assert result.returncode == 2
    assert "--cp 2: the demo model has no context-parallel form" in result.stderr


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_cp_2_run_trains(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    result = run_cli("train", "--model", RECIPE, "--stages", "2", "--cp", "2", "--steps", "2",
                     "--batch-size", "8", "--microbatches", "2", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "on 4 CPU ranks (p=2, dp=1, cp=2, tp=1" in result.stdout, result.stdout
    assert (tmp_path / "summary.json").is_file()
