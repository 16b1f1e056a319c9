"""The profiler and torch builders on small real models (CPU, one thread)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from partition import (
    Method,
    ProfileError,
    graph_from_fx,
    graph_from_layers,
    partition_graph,
    partition_layers,
)

__all__: list[str] = []


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)


def small_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 8))


def test_profiled_chain_has_positive_plausible_costs() -> None:
    graph = graph_from_layers(small_model(), torch.randn(16, 32), repeats=3)
    assert graph.names == ("0", "1", "2", "3")
    assert [layer.type_name for layer in graph.layers] == ["Linear", "ReLU", "Linear", "Linear"]
    for layer in graph.layers:
        assert 0 < layer.forward < 0.5 and 0 < layer.backward < 0.5
    assert [layer.params for layer in graph.layers] == [
        (32 * 64 + 64) * 4,
        0,
        (64 * 64 + 64) * 4,
        (64 * 8 + 8) * 4,
    ]
    assert [layer.activation for layer in graph.layers] == [16 * 64 * 4] * 3 + [16 * 8 * 4]
    assert [edge.bytes for edge in graph.edges] == [16 * 64 * 4] * 3
    result = partition_graph(graph, 2)
    assert result.bottleneck > 0 and result.boundaries[0] == 0 and result.boundaries[-1] == 4


def test_profiling_leaves_the_model_as_it_was() -> None:
    norm = nn.BatchNorm1d(8)
    model = nn.Sequential(nn.Linear(8, 8), norm)
    running_mean = torch.as_tensor(norm.running_mean).clone()
    graph_from_layers(model, torch.randn(4, 8), repeats=2)
    assert torch.equal(torch.as_tensor(norm.running_mean), running_mean)
    assert all(parameter.grad is None for parameter in model.parameters())


def test_in_place_layers_and_integer_inputs_profile() -> None:
    model = nn.Sequential(nn.Embedding(50, 16), nn.ReLU(inplace=True), nn.Linear(16, 4))
    graph = graph_from_layers(model, torch.randint(0, 50, (4, 7)), repeats=2)
    assert graph.layers[0].params == 50 * 16 * 4
    assert graph.layers[0].backward > 0


def test_a_layer_that_fails_names_itself() -> None:
    with pytest.raises(ProfileError, match="layer '1' failed"):
        graph_from_layers(nn.Sequential(nn.Linear(4, 4), nn.Linear(5, 2)), torch.randn(2, 4))


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(16, 16)
        self.outer = nn.Linear(16, 16)
        self.scale = nn.Parameter(torch.ones(16))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.inner(x)
        mixed = torch.relu(self.outer(hidden)) + hidden * self.scale
        return self.head(mixed)


def test_fx_graph_keeps_the_skip_connection() -> None:
    graph = graph_from_fx(Residual(), torch.randn(8, 16), repeats=2, bandwidth=1e9)
    assert not graph.is_chain
    assert graph.names[0] == "x"  # the input is a zero-cost layer
    names = graph.names
    skip = (names.index("inner"), names.index("mul"))
    assert skip in [(edge.source, edge.target) for edge in graph.edges]
    assert graph.layers[names.index("mul")].params == 16 * 4  # get_attr charged to its user
    result = partition_graph(graph, 2)
    assert result.bottleneck > 0 and sum(result.comm) > 0


def test_partition_layers_profiles_with_a_sample_input() -> None:
    cuts = partition_layers(small_model(), 2, Method.BALANCED, sample_input=torch.randn(16, 32))
    assert len(cuts) == 3 and cuts[0] == 0 and cuts[-1] == 4
    assert partition_layers(small_model(), 2, "parameters") == (0, 2, 4)
    assert partition_layers(small_model(), 2, "type:linear") == (0, 2, 4)


def test_json_path_does_not_import_torch() -> None:
    code = (
        "import sys, partition\n"
        "g = partition.graph_from_json({'layers': [{'forward': 1}, {'forward': 2}]})\n"
        "partition.partition_graph(g, 2)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
