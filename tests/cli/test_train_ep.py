"""`pipesched train --expert-parallel` / `--expert-tensor-parallel`: sizes that cannot split
are one line before any rank; experts split over tp train as whole ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.cli_helpers import call_cli

RECIPE = "examples/hf_moe_recipe.py:build"


def _one_line_refusal(*args: str) -> str:
    result = call_cli("train", *args, "--steps", "1", "--batch-size", "12",
                      "--microbatches", "2")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "training" not in result.stdout, result
    assert lines[0].startswith("pipesched train: error: "), lines
    return lines[0]


def test_ep_not_dividing_dp_is_one_line_naming_the_valid_sizes() -> None:
    line = _one_line_refusal("--model", RECIPE, "--stages", "1", "--data-parallel", "3",
                             "--expert-parallel", "2")
    assert "--expert-parallel 2 must divide --data-parallel 3" in line
    assert line.endswith("choose among [1, 3]"), line


def test_ep_not_dividing_the_experts_is_one_line() -> None:
    pytest.importorskip("transformers")
    line = _one_line_refusal("--model", RECIPE, "--stages", "1", "--data-parallel", "3",
                             "--expert-parallel", "3")
    assert "expert_parallel=3 must divide the 4 experts" in line and "[1, 2, 4]" in line


def test_ep_on_the_demo_model_is_refused() -> None:
    line = _one_line_refusal("--stages", "1", "--data-parallel", "2",
                             "--expert-parallel", "2")
    assert "--expert-parallel 2: the demo model has no experts" in line


def test_two_batch_overlap_without_an_expert_all_to_all_is_one_line() -> None:
    line = _one_line_refusal("--model", RECIPE, "--stages", "1", "--data-parallel", "2",
                             "--two-batch-overlap")
    assert "--two-batch-overlap hides the expert all-to-all" in line
    assert "--expert-parallel > 1" in line


def test_hf_whole_batch_balancing_is_one_line_naming_the_census_free_methods(
        tmp_path: Path) -> None:
    """A recipe whose layers add HF's whole-batch loss (it needs a census forward the command
    does not run) is refused naming the methods it does run."""
    pytest.importorskip("transformers")
    recipe = tmp_path / "hf_batch_recipe.py"
    recipe.write_text(
        "import dataclasses\n"
        "from examples import hf_moe_recipe as base\n"
        "from pipeline.interop.hf_layers import layers_from_hf\n\n"
        "def build():\n"
        "    hf = layers_from_hf(base.CONFIG, balancing='hf-batch')\n"
        "    return dataclasses.replace(base.build(), layers=hf.layers)\n")
    line = _one_line_refusal("--model", f"{recipe}:build", "--stages", "1")
    assert "HF's whole-batch load-balancing loss" in line
    assert "balancing='microbatch'" in line, line


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_batch_overlap_on_local_ranks_says_it_will_be_slower(tmp_path: Path) -> None:
    # issue 46: the CPU demo ran 5.6x slower under --two-batch-overlap with no word
    from tests.support.cli_helpers import run_cli

    result = run_cli("train", "--model", RECIPE, "--stages", "2", "--data-parallel", "2",
                     "--expert-parallel", "2", "--two-batch-overlap", "--steps", "1",
                     "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "note: --two-batch-overlap hides an expert all-to-all" in result.stderr
    assert "expect each step slower" in result.stderr


def test_expert_tensor_parallel_other_than_1_or_tp_is_one_line() -> None:
    line = _one_line_refusal("--model", RECIPE, "--stages", "1", "--data-parallel", "2",
                             "--tp", "2", "--expert-parallel", "2",
                             "--expert-tensor-parallel", "4")
    assert "--expert-tensor-parallel 4 must be 1 (experts whole) or --tp 2" in line, line


TP_RECIPE = (
    "import dataclasses, functools\n"
    "from examples import hf_moe_recipe as base\n"
    "from pipeline.interop.hf_layers import layers_from_hf\n"
    "from pipeline.interop.hf_tensor_parallel import check_tensor_parallel_size, "
    "tensor_parallel_hf\n\n"
    "def build():\n"
    "    hf = tensor_parallel_hf(layers_from_hf(base.CONFIG))\n"
    "    return dataclasses.replace(base.build(), layers=hf.layers, loss_fn=hf.loss_fn,\n"
    "        check_tensor_parallel=functools.partial(check_tensor_parallel_size, base.CONFIG))\n")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_expert_tensor_parallel_trains_as_whole_experts_do(tmp_path: Path) -> None:
    """tp 2 × ep 2 with the experts split over tp: both steps' losses (the second after an
    Adam update) equal those of the same command with whole experts."""
    from tests.support.cli_helpers import run_cli

    pytest.importorskip("transformers")
    recipe = tmp_path / "tp_moe_recipe.py"
    recipe.write_text(TP_RECIPE)
    losses = {}
    for etp in ("1", "2"):
        out = tmp_path / f"etp{etp}"
        result = run_cli("train", "--model", f"{recipe}:build", "--stages", "1",
                         "--data-parallel", "2", "--tp", "2", "--expert-parallel", "2",
                         "--expert-tensor-parallel", etp, "--steps", "2", "--batch-size", "8",
                         "--microbatches", "2", "--out", str(out))
        assert result.returncode == 0, result.stderr
        assert ("etp=2" in result.stdout) == (etp == "2"), result.stdout
        losses[etp] = json.loads((out / "summary.json").read_text())["losses"]
    assert len(losses["2"]) == 2, losses
    for whole, split in zip(losses["1"], losses["2"]):
        assert abs(split - whole) <= 1e-5 * abs(whole), losses
