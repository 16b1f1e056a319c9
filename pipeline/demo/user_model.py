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
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.model.module import PipelineModule

__all__ = ["ModelRecipe", "UserCodeError", "check_recipe", "load_recipe", "rows_of"]


class UserCodeError(ValueError):
    """The user's `--model` code raised (or does not compile): the message is one line
    naming the file, the line and the exception; `details` holds the whole traceback."""

    def __init__(self, message: str, details: str) -> None:
        super().__init__(message)
        self.details = details


_LIBRARIES = tuple(str(Path(root).resolve()) for root in
                   {sys.prefix, sys.base_prefix, str(Path(__file__).resolve().parents[2])})


def _user_code_error(spec: str, doing: str, error: BaseException) -> UserCodeError:
    """One line for an exception raised by the user's code: the innermost frame outside
    Python, its libraries and pipesched (where the user's own code went wrong)."""
    import traceback

    details = "".join(traceback.format_exception(error))
    if isinstance(error, SyntaxError):
        place = f"{error.filename}:{error.lineno}"
    else:
        frames = traceback.extract_tb(error.__traceback__)
        own = [frame for frame in frames
               if not str(Path(frame.filename).resolve()).startswith(_LIBRARIES)]
        frame = (own or frames)[-1] if frames else None
        place = f"{frame.filename}:{frame.lineno}" if frame is not None else spec
    text = str(error).splitlines()[0] if str(error) else ""
    return UserCodeError(f"--model {spec}: {doing} raised {type(error).__name__} at {place}"
                         f"{': ' + text if text else ''}", details)


@dataclass(frozen=True)
class ModelRecipe:
    """What `--model module:function` returns."""

    layers: Sequence[Any]
    """The layer list, as `PipelineModule` takes it (modules, LayerSpecs, callables)."""
    loss_fn: Callable[[Any, Any], torch.Tensor]
    """``loss_fn(outputs, targets)`` -> the mean loss of a microbatch."""
    batch: Callable[[int, int], tuple[Any, Any]]
    """``batch(step, batch_size)`` -> (inputs, targets); the same for a step on every rank."""
    check_tensor_parallel: Callable[[int], None] | None = None
    """Raises ValueError when the layers cannot split over ``--tp`` ranks (for
    `tensor_parallel_hf` layers: ``functools.partial(check_tensor_parallel_size, config)``);
    called before any rank starts. None: ``--tp`` above 1 is refused."""
    check_context_parallel: Callable[[int], None] | None = None
    """Raises ValueError when the layers cannot split each sequence over ``--cp`` ranks (for
    `context_parallel_hf` layers: ``functools.partial(check_context_parallel_sequence,
    sequence_length)``); called before any rank starts. None: ``--cp`` above 1 is refused."""


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
    if os.getcwd() not in sys.path and "" not in sys.path:
        # `python -m` would import from here; the `pipesched` console script's path lacks it,
        # and the message below tells the user to run from the module's directory
        sys.path.append(os.getcwd())
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
    except ValueError:
        raise
    except Exception as error:  # the user's module: any exception, one line
        raise _user_code_error(spec, f"importing {module_name}", error) from None
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
    except Exception as error:  # the user's function: any exception, one line
        raise _user_code_error(spec, f"{function_name}()", error) from None
    except SystemExit as stop:  # would end `pipesched train` with its code and no output
        raise ValueError(f"--model: {spec} called sys.exit({stop.code!r}) instead of returning "
                         "a ModelRecipe; return ModelRecipe(layers=..., loss_fn=..., "
                         "batch=...)") from None
    if isinstance(recipe, Mapping):
        missing = sorted({"layers", "loss_fn", "batch"} - set(recipe))
        if missing:
            raise ValueError(f"--model: {spec} returned a dict without {missing}; return "
                             "ModelRecipe(layers=..., loss_fn=..., batch=...)")
        recipe = ModelRecipe(recipe["layers"], recipe["loss_fn"], recipe["batch"],
                             recipe.get("check_tensor_parallel"),
                             recipe.get("check_context_parallel"))
    if not isinstance(recipe, ModelRecipe):
        raise ValueError(f"--model: {spec} returned {type(recipe).__name__}; return "
                         "pipeline.demo.user_model.ModelRecipe(layers=..., loss_fn=..., "
                         "batch=...)")
    if not callable(recipe.loss_fn) or not callable(recipe.batch) or not all(
            check is None or callable(check) for check in (recipe.check_tensor_parallel,
                                                           recipe.check_context_parallel)):
        raise ValueError(f"--model: {spec}: loss_fn, batch, check_tensor_parallel and "
                         "check_context_parallel must be callables")
    return recipe


def rows_of(value: Any, rows: slice) -> Any:
    """The rows `rows` (along dim 0) of a batch part: a tensor, or a tuple / list of them
    (each sliced, e.g. ``(ids, mask)``)."""
    if isinstance(value, torch.Tensor):
        return value[rows]
    if isinstance(value, tuple | list):
        return type(value)(rows_of(part, rows) for part in value)
    raise TypeError(f"a batch part must be a tensor or a tuple of tensors, got "
                    f"{type(value).__name__}")


def _batch_problems(name: str, value: Any, batch_size: int) -> list[str]:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] != batch_size:
            return [f"{name} has shape {tuple(value.shape)}, not {batch_size} rows"]
        return []
    if isinstance(value, tuple | list) and value:
        return [problem for k, part in enumerate(value)
                for problem in _batch_problems(f"{name}[{k}]", part, batch_size)]
    return [f"{name} is {type(value).__name__}, not a tensor or a tuple of tensors"]


def check_recipe(spec: str, recipe: ModelRecipe, *, stages: int, chunks: int,
                 batch_size: int) -> None:
    """Before any rank starts: the layers pass `PipelineModule`'s build check (no weight
    hidden from training), and ``batch(0, batch_size)`` gives (inputs, targets) made of
    tensors of `batch_size` rows (so they split into replicas and microbatches). Every
    problem is a one-line ValueError naming `spec`."""
    try:
        PipelineModule(list(recipe.layers), num_stages=stages, chunks=chunks,
                       loss_fn=recipe.loss_fn)
    except (ValueError, TypeError) as error:
        raise ValueError(f"--model {spec}: {error}") from error
    batch = recipe.batch(0, batch_size)
    if not (isinstance(batch, tuple | list) and len(batch) == 2):
        raise ValueError(f"--model {spec}: batch(step, size) must return (inputs, targets), "
                         f"got {type(batch).__name__}")
    problems = _batch_problems("inputs", batch[0], batch_size) + _batch_problems(
        "targets", batch[1], batch_size)
    if problems:
        raise ValueError(f"--model {spec}: batch(0, {batch_size}): {'; '.join(problems)}; "
                         "return tensors (or tuples of tensors) whose first dimension is the "
                         "batch size")
