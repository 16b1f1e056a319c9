"""Layers whose weights a pipeline would silently not train are refused; errors name the fix."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline import LayerSpec, PipelineModule, TiedLayerSpec
from pipeline.errors import PipelineConfigError, PipelineLayerError
from pipeline.model.layer_checks import find_hidden_modules
from pipeline.runtime.batch import split_microbatches
from tests.runtime import hidden_weight_helpers
from tests.runtime.hidden_weight_helpers import (
    ClassAttributeBlock,
    ClassAttributeCallable,
    SlotsCallable,
    TensorAttributeBlock,
)

_GLOBAL_NORM = nn.LayerNorm(4)


class _Holder:
    """A callable object (not a module) that keeps a module as an attribute."""

    def __init__(self) -> None:
        self.proj = nn.Linear(4, 4)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class _Builder:
    """A plain object whose method builds a layer list closing over `self`."""

    def __init__(self) -> None:
        self.norm = nn.LayerNorm(4)

    def layer(self) -> Any:
        return lambda x: self.norm(x)


def _hidden_callables() -> dict[str, Any]:
    norm = nn.LayerNorm(4)
    weight = nn.Parameter(torch.ones(4))
    return {
        "closure variable 'norm'": lambda x: norm(x),
        "global '_GLOBAL_NORM'": lambda x: _GLOBAL_NORM(x),
        "bound method's self": norm.forward,
        "partial keyword 'weight'": functools.partial(F.layer_norm, normalized_shape=(4,),
                                                      weight=weight),
        "attribute 'proj'": _Holder(),
        "closure variable 'self'.norm": _Builder().layer(),
    }


@pytest.mark.parametrize("path", sorted(_hidden_callables()))
def test_callable_hiding_parameters_is_refused_naming_layer_and_fix(path: str) -> None:
    layers = [nn.Linear(4, 4), _hidden_callables()[path], nn.Linear(4, 4)]
    with pytest.raises(PipelineConfigError) as info:
        PipelineModule(layers, num_stages=1)
    message = str(info.value)
    assert "layer 1" in message and path in message
    assert "make that module the layer itself" in message
    assert "its the " not in message  # regression: "through its the bound method's self"


def _deeply_nested(norm: nn.Module) -> Any:
    config = {"blocks": [{"parts": ({"norm": [norm]},)}]}  # five containers deep
    return lambda x: config["blocks"][0]["parts"][0]["norm"][0](x)


def _hiding_layers() -> dict[str, tuple[Any, str]]:
    """Each second hiding place the build check missed: (layer, the path it must name)."""
    scale = torch.ones(4, requires_grad=True)
    return {
        "class attribute of a module": (ClassAttributeBlock(),
                                        "class attribute ClassAttributeBlock.proj"),
        "class attribute of a LayerSpec's class": (LayerSpec(ClassAttributeBlock),
                                                   "class attribute ClassAttributeBlock.proj"),
        "class attribute of a callable": (ClassAttributeCallable(),
                                          "class attribute ClassAttributeCallable.norm"),
        "__slots__": (SlotsCallable(), "slot 'proj'"),
        "nested five deep": (_deeply_nested(nn.LayerNorm(4)),
                             "closure variable 'config'['blocks'][0]['parts'][0]['norm'][0]"),
        "imported module's attribute": (lambda x: hidden_weight_helpers.NORM(x),
                                        "global 'hidden_weight_helpers'.NORM"),
        "plain tensor requiring grad": (lambda x: x * scale, "closure variable 'scale'"),
        "plain tensor attribute of a module": (TensorAttributeBlock(), "attribute scale"),
    }


@pytest.mark.parametrize("case", sorted(_hiding_layers()))
def test_weights_hidden_elsewhere_are_refused_naming_layer_and_fix(case: str) -> None:
    """Regression: each of these trained nothing of the hidden weight, without a word."""
    layer, path = _hiding_layers()[case]
    with pytest.raises(PipelineConfigError) as info:
        PipelineModule([nn.Linear(4, 4), layer, nn.Linear(4, 4)], num_stages=2)
    message = str(info.value)
    assert "layer 1 (" in message and f"through its {path}:" in message, message
    assert "make that module the layer itself" in message or "nn.Parameter" in message


def test_a_module_layer_referencing_its_own_modules_is_accepted() -> None:
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)
            self.alias = [self.inner]  # a plain list, but of a registered module
            self.cache = torch.zeros(4)  # a tensor without requires_grad: not a weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.alias[0](x) + self.cache

    PipelineModule([Wrapper(), nn.Linear(4, 4)], num_stages=2)


def test_layer_spec_returning_one_module_at_two_positions_is_refused() -> None:
    """Regression: `LayerSpec(lambda: shared)` twice built two untied copies (loss 5.6e-4 off
    the single process)."""
    shared = nn.Linear(4, 4)
    spec = LayerSpec(lambda: shared)
    with pytest.raises(PipelineConfigError, match=r"layers \[0, 2\] share weights.*"
                                                  r"tie_shared=True"):
        PipelineModule([spec, torch.tanh, spec], num_stages=2)
    PipelineModule([spec, torch.tanh, nn.Linear(4, 4)], num_stages=2)  # once: a plain layer
    module = PipelineModule([spec, torch.tanh, spec], num_stages=2, tie_shared=True)
    assert module.tied_keys == {0: "shared-layers-0", 2: "shared-layers-0"}


def test_parameter_free_callables_are_accepted() -> None:
    scale = 2.0
    layers = [nn.Linear(4, 4), torch.tanh, lambda x: x * scale, F.relu,
              functools.partial(torch.clamp, min=0.0)]
    assert [find_hidden_modules(layer) for layer in layers[1:]] == [[], [], [], []]
    assert PipelineModule(layers, num_stages=2).num_layers == 5


def test_frozen_module_in_a_callable_is_accepted() -> None:
    frozen = nn.Linear(4, 4).requires_grad_(False)
    PipelineModule([nn.Linear(4, 4), lambda x: frozen(x)], num_stages=2)


def test_module_listed_twice_is_refused_naming_both_positions() -> None:
    block = nn.Linear(4, 4)
    with pytest.raises(PipelineConfigError, match=r"layers \[0, 2\].*same Linear object.*"
                                                  r"tie_shared=True"):
        PipelineModule([block, torch.tanh, block], num_stages=2)


def test_hf_style_tied_head_is_refused_naming_the_parameters() -> None:
    """Regression: an lm_head sharing the embedding's weight lost its tie without a word."""
    embed = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = embed.weight
    with pytest.raises(PipelineConfigError) as info:
        PipelineModule([embed, nn.Linear(4, 4), head], num_stages=2)
    message = str(info.value)
    assert "layers [0, 2]" in message and "layer 0's 'weight' is layer 2's 'weight'" in message
    assert "TiedLayerSpec" in message


def test_tie_shared_turns_shared_modules_into_one_tied_key() -> None:
    embed = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = embed.weight
    module = PipelineModule([embed, nn.Linear(4, 4), head], num_stages=2, tie_shared=True)
    assert module.tied_keys == {0: "shared-layers-0", 2: "shared-layers-0"}
    module.materialize([0, 1])
    assert module(torch.tensor([[1, 2, 3]])).shape == (1, 3, 10)
    (weight,) = module.tied_parameters()["shared-layers-0"]
    assert weight is embed.weight


def test_module_list_is_accepted_as_the_layer_list() -> None:
    blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    assert PipelineModule(blocks, num_stages=2).num_layers == 2


def test_nested_module_list_is_refused_with_splice_hint() -> None:
    """Regression: `model.transformer.h` was refused with a hint that made one layer of it."""
    blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    with pytest.raises(TypeError, match=r"layer 1 is a ModuleList of 2 modules.*\*model"):
        PipelineModule([nn.Linear(4, 4), blocks], num_stages=2)


def test_single_module_is_refused_with_children_hint() -> None:
    with pytest.raises(TypeError, match=r"list\(model.children\(\)\)"):
        PipelineModule(nn.Linear(4, 4), num_stages=1)  # type: ignore[arg-type]


def test_equal_looking_tied_factories_are_told_apart() -> None:
    """Regression: two lambdas were described by two identical texts."""
    first = TiedLayerSpec("embed", lambda: nn.Embedding(10, 4))
    second = TiedLayerSpec("embed", lambda: nn.Embedding(10, 4))
    with pytest.raises(PipelineConfigError) as info:
        PipelineModule([first, nn.Linear(4, 4), second], num_stages=2)
    message = str(info.value)
    assert "layer 2 builds with" in message and "same object to every occurrence" in message
    left, right = message.split("layer 2 builds with ")[1].split(" but an earlier occurrence")
    assert left != right.split("builds with ")[1].split(": two factory")[0]


@pytest.mark.parametrize("cuts", [np.array([0, 1, 3]), [np.int64(0), np.int32(1), np.int64(3)]])
def test_numpy_cut_indices_are_accepted(cuts: Any) -> None:
    module = PipelineModule([nn.Linear(4, 4)] * 1 + [torch.tanh, nn.Linear(4, 4)], num_stages=2,
                            partition_method=cuts)
    assert module.boundaries == (0, 1, 3)


def test_float_cut_indices_are_refused() -> None:
    with pytest.raises(PipelineConfigError, match="cut indices"):
        PipelineModule([nn.Linear(4, 4), torch.tanh], num_stages=2,
                       partition_method=[0, 1.0, 2])


def test_iterator_passed_as_inputs_names_data_iter() -> None:
    """Regression: a DeepSpeed-style iterator got 'inputs must be a tensor'."""
    batches = iter([(torch.zeros(2, 4), torch.zeros(2))])
    with pytest.raises(TypeError, match=r"iterator.*data_iter=it"):
        split_microbatches(batches, 1, "inputs")


def test_failing_layer_is_named_with_its_global_index() -> None:
    module = PipelineModule([LayerSpec(nn.Linear, 4, 4), torch.tanh, LayerSpec(nn.Linear, 5, 4)],
                            num_stages=2, partition_method=[0, 1, 3])
    module.materialize([0, 1])
    with pytest.raises(PipelineLayerError, match=r"layer 2 \(Linear\) failed.*layer 1's output") \
            as info:
        module(torch.zeros(2, 4))
    assert info.value.layer == 2


def _in_place_module(clone: bool | None) -> PipelineModule:
    layers = [LayerSpec(nn.Linear, 4, 4), nn.ReLU(inplace=True), LayerSpec(nn.Linear, 4, 4)]
    return PipelineModule(layers, num_stages=2, partition_method=[0, 1, 3],
                          clone_stage_inputs=clone)


def test_received_input_is_cloned_before_an_in_place_first_layer() -> None:
    module = _in_place_module(None)
    module.materialize([0, 1])
    assert module.stage(1).clone_input and not module.stage(0).clone_input
    received = torch.randn(2, 4).requires_grad_(True)  # as the interpreter makes it
    module.stage(1)(received).sum().backward()
    assert received.grad is not None


def test_in_place_on_a_received_input_names_layer_and_fix() -> None:
    module = _in_place_module(False)
    module.materialize([0, 1])
    with pytest.raises(PipelineLayerError, match=r"layer 1 \(ReLU\).*clone_stage_inputs=True"):
        module.stage(1)(torch.randn(2, 4).requires_grad_(True))
