"""`pipesched train --model module:function` trains a user's layer list (profiled, balanced)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from pipeline.demo.user_model import ModelRecipe, load_recipe
from tests.support.cli_helpers import call_cli, run_cli

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


class Masked(nn.Module):
    """Takes (x, mask): a tuple input, as a HF model's (ids, attention_mask)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(12, 24)

    def forward(self, pair):
        x, mask = pair
        return self.proj(x * mask)


def tuple_batch(step, size):
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(size, 12, generator=generator)
    mask = (torch.rand(size, 12, generator=generator) > 0.2).float()
    return (x, mask), (x * mask).sum(dim=1, keepdim=True)


def build_tuple():
    layers = [LayerSpec(Masked), torch.tanh, LayerSpec(nn.Linear, 24, 24), torch.tanh,
              LayerSpec(nn.Linear, 24, 1)]
    return ModelRecipe(layers=layers, loss_fn=F.mse_loss, batch=tuple_batch)


def build_hidden():
    norm = nn.LayerNorm(24)
    layers = [LayerSpec(nn.Linear, 12, 24), lambda x: norm(x), LayerSpec(nn.Linear, 24, 1)]
    return ModelRecipe(layers=layers, loss_fn=F.mse_loss, batch=batch)


def build_short_batch():
    layers = [LayerSpec(nn.Linear, 12, 24), torch.tanh, LayerSpec(nn.Linear, 24, 1)]
    return ModelRecipe(layers=layers, loss_fn=F.mse_loss,
                       batch=lambda step, size: batch(step, size - 1))
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
    (":missing", "no function 'missing'; callables there: Masked, batch, build, build_hidden, "
                 "build_short_batch, build_tuple, not_a_recipe, tuple_batch"),
    (":not_a_recipe", "returned list; return"),
])
def test_bad_model_specs_name_the_fix(tmp_path: Path, suffix: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_recipe(f"{_write(tmp_path)}{suffix}")


def test_module_name_imports_from_the_working_directory_without_it_on_the_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: `pipesched train --model my_model:build` run next to my_model.py failed (the
    console script's sys.path has no working directory) while its message said to do that."""
    _write(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_model", raising=False)
    try:
        recipe = load_recipe("my_model:build")
    finally:
        sys.modules.pop("my_model", None)
    assert isinstance(recipe, ModelRecipe) and len(recipe.layers) == 5


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
    done = call_cli("train", "--model", f"{_write(tmp_path)}:build", "--stages", "8",
                    "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert "has 5 layers, too few for 8 stages" in done.stderr


@pytest.mark.multiprocess
@pytest.mark.slow
def test_tuple_inputs_split_over_data_parallel_replicas(tmp_path: Path) -> None:
    """Regression: with --data-parallel 2 the job sliced the (x, mask) tuple itself, not its
    tensors, and the ranks crashed."""
    out = tmp_path / "out"
    done = run_cli("train", "--model", f"{_write(tmp_path)}:build_tuple", "--stages", "2",
                   "--data-parallel", "2", "--microbatches", "2", "--steps", "2",
                   "--batch-size", "8", "--out", str(out), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(json.loads((out / "summary.json").read_text())["losses"]) == 2


@pytest.mark.parametrize(("function", "message"), [
    ("build_hidden", r"--model .*:build_hidden: PipelineModule: layer 1 \(.*lambda.*\) reaches "
                     r"LayerNorm.*make that module the layer itself"),
    ("build_short_batch", r"--model .*:build_short_batch: batch\(0, 8\): inputs has shape "
                          r"\(7, 12\), not 8 rows"),
])
def test_refused_recipe_fails_in_one_line_before_any_rank(tmp_path: Path, function: str,
                                                          message: str) -> None:
    """Regression: the build check refused the recipe inside every rank: tracebacks, exit 1."""
    done = call_cli("train", "--model", f"{_write(tmp_path)}:{function}", "--stages", "2",
                    "--microbatches", "2", "--batch-size", "8", "--out", str(tmp_path / "out"))
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "training" not in done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and re.match(r"pipesched train: error: " + message, lines[0]), lines
