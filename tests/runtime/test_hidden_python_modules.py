"""Weights hidden behind a Python module reached other than as a module global are refused,
as the global case is: a closure variable (``import mylib`` in a builder),
``importlib.import_module``, a local ``types.ModuleType``, an instance attribute. Also the
refusal's wording and a layer whose ``__getattr__`` raises KeyError."""

from __future__ import annotations

import importlib
import types
from typing import Any

import pytest
import torch
from torch import nn

from pipeline import PipelineModule
from pipeline.errors import PipelineConfigError
from tests.runtime import hidden_weight_helpers


def _closure_import() -> Any:
    """A builder importing the library itself: the lambda reaches it as a closure variable."""
    import tests.runtime.hidden_weight_helpers as mylib
    return lambda x: mylib.NORM(x)


def _local_namespace() -> Any:
    namespace = types.ModuleType("namespace")
    namespace.norm = nn.LayerNorm(4)  # type: ignore[attr-defined]
    return lambda x: namespace.norm(x)


class _LibraryCallable:
    """A callable object keeping the library as an instance attribute."""

    def __init__(self) -> None:
        self.lib = hidden_weight_helpers

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.lib.NORM(x)


class _LibraryBlock(nn.Module):
    """A module layer keeping the library as a plain attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.lib = hidden_weight_helpers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lib.NORM(x)


class _GlobalInCall:
    """A callable whose __call__ reads a module global (the path goes through __call__)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return hidden_weight_helpers.NORM(x)


def _cases() -> dict[str, tuple[Any, str]]:
    """(layer, the path the refusal must name), one per way of reaching a module."""
    return {
        "closure variable": (_closure_import(), "closure variable 'mylib'.NORM"),
        "importlib.import_module": (
            lambda x: importlib.import_module("tests.runtime.hidden_weight_helpers").NORM(x),
                                    "imported module 'tests.runtime.hidden_weight_helpers'.NORM"),
        "local types.ModuleType": (_local_namespace(), "closure variable 'namespace'.norm"),
        "instance attribute of a callable": (_LibraryCallable(), "attribute 'lib'.NORM"),
        "attribute of a module layer": (_LibraryBlock(), "attribute lib.NORM"),
        "global read in __call__": (_GlobalInCall(),
                                    "__call__ -> global 'hidden_weight_helpers'.NORM"),
    }


@pytest.mark.parametrize("case", sorted(_cases()))
def test_weights_behind_a_python_module_are_refused_naming_the_path(case: str) -> None:
    """Regression: each was accepted and its LayerNorm never trained."""
    layer, path = _cases()[case]
    with pytest.raises(PipelineConfigError) as info:
        PipelineModule([nn.Linear(4, 4), layer, nn.Linear(4, 4)], num_stages=2)
    message = str(info.value)
    assert "layer 1 (" in message and f"through its {path}:" in message, message
    assert "its its" not in message  # regression: "through its its __call__"


def test_module_attributes_the_code_does_not_read_are_not_weights() -> None:
    """Only what the code names is followed: a library holding a module the layer never
    uses is accepted (a walk of every attribute would refuse it)."""
    lib = types.ModuleType("lib")
    lib.unused = nn.LayerNorm(4)  # type: ignore[attr-defined]
    lib.scale = 2.0  # type: ignore[attr-defined]
    PipelineModule([nn.Linear(4, 4), lambda x: x * lib.scale, nn.Linear(4, 4)], num_stages=2)


class _Config:
    """A config object whose __getattr__ reads a dict: missing names raise KeyError."""

    def __init__(self) -> None:
        self.values = {"norm": nn.LayerNorm(4)}

    def __getattr__(self, name: str) -> Any:
        return self.__dict__["values"][name]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.values["norm"](x)


def test_layer_whose_getattr_raises_key_error_is_refused_by_name() -> None:
    """Regression: the checker crashed with a bare KeyError: '__qualname__'."""
    with pytest.raises(PipelineConfigError, match=r"layer 1 \(_Config\) reaches LayerNorm"):
        PipelineModule([nn.Linear(4, 4), _Config(), nn.Linear(4, 4)], num_stages=2)


def test_module_twice_inside_one_stage_is_refused_without_blaming_stages() -> None:
    """Regression: the refusal said "each pipeline stage would train its own copy" for two
    positions of one stage (num_stages=1: there is one stage)."""
    block = nn.Linear(4, 4)
    with pytest.raises(PipelineConfigError) as info:
        PipelineModule([block, torch.tanh, block], num_stages=1)
    message = str(info.value)
    assert "layers [0, 2] share weights" in message and "tie_shared=True" in message
    assert "each pipeline stage would train its own copy" not in message
