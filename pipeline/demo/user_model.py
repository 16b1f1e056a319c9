"""A user's model for `pipesched train --model module:function`: the recipe and its loader.

The function takes no arguments and returns a `ModelRecipe` (or a dict with the same keys):
the layer list, the loss, and a batch maker that gives the same batch for a step on every
rank. ``module`` is an importable module name or a path to a ``.py`` file:

    # my_model.py
    def build() -> ModelRecipe:
        return ModelRecipe(layers=[LayerSpec(nn.Linear, 32, 32), torch.tanh, ...],
                           loss_fn=F.mse_loss, batch=lambda step, size: (x, y))

    pipesched train --model my_model.py:build --stages 2
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["ModelRecipe", "load_recipe"]


@dataclass(frozen=True)
class ModelRecipe:
    """What `--model module:function` returns."""

    layers: Sequence[Any]
    """The layer list, as `PipelineModule` takes it (modules, LayerSpecs, callables)."""
    loss_fn: Callable[[Any, Any], torch.Tensor]
    """``loss_fn(outputs, targets)`` -> the mean loss of a microbatch."""
    batch: Callable[[int, int], tuple[Any, Any]]
    """``batch(step, batch_size)`` -> (inputs, targets); the same for a step on every rank."""


def _import(module: str) -> Any:
    path = Path(module)
    if module.endswith(".py"):
        if not path.is_file():
            raise ValueError(f"--model: no file {module}; give an existing .py path or an "
                             "importable module name")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"--model: cannot load {module} as Python")
        loaded = importlib.util.module_from_spec(spec)
        sys.modules.setdefault(path.stem, loaded)
        spec.loader.exec_module(loaded)
        return loaded
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ValueError(f"--model: cannot import {module!r} ({error}); run from the directory "
                         "that holds it, set PYTHONPATH, or pass a path to the .py file") \
            from error


def load_recipe(spec: str) -> ModelRecipe:
    """Import ``module:function`` and call it; every problem is a ValueError naming the fix."""
    module_name, colon, function_name = spec.rpartition(":")
    if not colon or not module_name or not function_name:
        raise ValueError(f"--model must be module:function (e.g. my_model.py:build), got "
                         f"{spec!r}")
    try:
        module = _import(module_name)
    except SystemExit as stop:
        raise ValueError(f"--model: importing {module_name} called sys.exit({stop.code!r}); "
                         "a model module must define functions, not run a program "
                         "(guard it with `if __name__ == '__main__':`)") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        found = sorted(name for name, value in vars(module).items()
                       if callable(value) and not name.startswith("_")
                       and getattr(value, "__module__", None) == module.__name__)
        raise ValueError(f"--model: {module_name} has no function {function_name!r}; "
                         f"callables there: {', '.join(found) or 'none'}")
    try:
        recipe = function()
    except SystemExit as stop:  # would end `pipesched train` with its code and no output
        raise ValueError(f"--model: {spec} called sys.exit({stop.code!r}) instead of returning "
                         "a ModelRecipe; return ModelRecipe(layers=..., loss_fn=..., "
                         "batch=...)") from None
    if isinstance(recipe, Mapping):
        missing = sorted({"layers", "loss_fn", "batch"} - set(recipe))
        if missing:
            raise ValueError(f"--model: {spec} returned a dict without {missing}; return "
                             "ModelRecipe(layers=..., loss_fn=..., batch=...)")
        recipe = ModelRecipe(recipe["layers"], recipe["loss_fn"], recipe["batch"])
    if not isinstance(recipe, ModelRecipe):
        raise ValueError(f"--model: {spec} returned {type(recipe).__name__}; return "
                         "pipeline.demo.user_model.ModelRecipe(layers=..., loss_fn=..., "
                         "batch=...)")
    if not callable(recipe.loss_fn) or not callable(recipe.batch):
        raise ValueError(f"--model: {spec}: loss_fn and batch must be callables")
    return recipe
