"""`pipesched train --model module:function` trains a user's layer list (profiled, balanced)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.demo.user_model import ModelRecipe, load_recipe
from tests.support.cli_helpers import run_cli

USER_MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn

from pipeline import LayerSpec
from pipeline.demo.user_model import ModelRecipe


def batch(step, size):
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(size, 12, generator=generator)
    return x, x.sum(dim=1, keepdim=True)


def build():
    layers = [LayerSpec(nn.Linear, 12, 24), torch.tanh, LayerSpec(nn.Linear, 24, 24),
              torch.tanh, LayerSpec(nn.Linear, 24, 1)]
    return ModelRecipe(layers=layers, loss_fn=F.mse_loss, batch=batch)


def not_a_recipe():
    return [1, 2]
'''


def _write(tmp_path: Path) -> Path:
    path = tmp_path / "my_model.py"
    path.write_text(USER_MODEL)
    return path


def test_recipe_loads_from_a_file_path(tmp_path: Path) -> None:
    recipe = load_recipe(f"{_write(tmp_path)}:build")
    assert isinstance(recipe, ModelRecipe) and len(recipe.layers) == 5


@pytest.mark.parametrize(("suffix", "message"), [
    ("", "must be module:function"),
    (":missing", "no function 'missing'; callables there: batch, build, not_a_recipe"),
    (":not_a_recipe", "returned list; return"),
])
def test_bad_model_specs_name_the_fix(tmp_path: Path, suffix: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_recipe(f"{_write(tmp_path)}{suffix}")


def test_unknown_module_names_the_fix() -> None:
    with pytest.raises(ValueError, match="PYTHONPATH"):
        load_recipe("no_such_module_anywhere:build")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_train_runs_a_user_model(tmp_path: Path) -> None:
    path = _write(tmp_path)
    out = tmp_path / "out"
    done = run_cli("train", "--model", f"{path}:build", "--stages", "2", "--microbatches", "2",
                   "--steps", "3", "--batch-size", "8", "--out", str(out), timeout=240)
    assert done.returncode == 0, done.stderr
    assert "balanced partition: 5 layers into 2 stages" in done.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["losses"]) == 3 and summary["boundaries"][-1] == 5


def test_train_refuses_a_model_with_too_few_layers(tmp_path: Path) -> None:
    done = run_cli("train", "--model", f"{_write(tmp_path)}:build", "--stages", "8",
                   "--out", str(tmp_path / "out"), timeout=120)
    assert done.returncode == 2
    assert "has 5 layers, too few for 8 stages" in done.stderr
