"""`pipesched train --tp`: a size the model cannot split over is one line before any rank;
a run that can prints no warning."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cli_helpers import call_cli, run_cli


def test_a_tp_the_model_cannot_take_is_one_line_naming_the_valid_sizes() -> None:
    pytest.importorskip("transformers")
    result = call_cli("train", "--model", "examples/hf_tensor_parallel_recipe.py:build",
                      "--stages", "2", "--tp", "3", "--steps", "1", "--batch-size", "8",
                      "--microbatches", "2")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "training" not in result.stdout, result
    assert lines[0].startswith("pipesched train: error: tensor parallel size 3 does not "
                               "divide llama's 4 attention heads"), lines
    assert lines[0].endswith("valid tensor parallel sizes: 1, 2, 4"), lines


def test_tp_on_the_demo_model_is_refused() -> None:
    result = call_cli("train", "--stages", "2", "--tp", "2", "--steps", "1")
    assert result.returncode == 2
    assert "--tp 2: the demo model has no tensor-parallel form" in result.stderr


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_tp_2_run_prints_no_warning_line(tmp_path: Path) -> None:
    # torch 2.13 deprecated all_gather_into_tensor / reduce_scatter_tensor: every sequence-
    # parallel collective warned on every rank (104 lines in 3 steps, 968 in 30)
    result = run_cli("train", "--model", "examples/hf_tensor_parallel_recipe.py:build",
                     "--stages", "2", "--tp", "2", "--steps", "2", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    warned = [line for line in (result.stdout + result.stderr).splitlines()
              if "Warning" in line]
    assert not warned, warned[:5]
