"""The model graph, its JSON reader and DAG cases with skip connections (no torch)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import networkx as nx
import pytest

from partition import (
    CostFileError,
    GraphError,
    InvalidCostError,
    LayerCost,
    Method,
    ModelGraph,
    PartitionError,
    chain_graph,
    graph_from_json,
    partition_graph,
)

__all__: list[str] = []


def write(tmp_path: Path, document: object) -> Path:
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(document))
    return path


def test_json_defaults_to_a_chain_carrying_activations(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        {
            "layers": [
                {"name": "a", "forward": 1, "backward": 2, "params": 10, "activation": 5},
                {"name": "b", "forward": 1, "activation": 7},
                {"forward": 3},
            ]
        },
    )
    graph = graph_from_json(path)
    assert graph.names == ("a", "b", "layer2")
    assert graph.layers[0].compute == 3.0
    assert [(e.source, e.target, e.bytes) for e in graph.edges] == [(0, 1, 5.0), (1, 2, 7.0)]
    assert graph.bandwidth is None and graph.is_chain


def test_json_edges_by_name_or_index_and_bandwidth() -> None:
    graph = graph_from_json(
        {
            "layers": [{"name": n, "forward": 1} for n in "abcd"],
            "edges": [["a", "b", 10], [1, 2, 10], ["c", 3, 10], ["a", "d", 40]],
            "bandwidth": 10,
        }
    )
    assert not graph.is_chain
    assert graph.bandwidth == 10.0
    assert graph.digraph.edges["a", "d"]["bytes"] == 40.0
    assert graph.digraph.nodes["b"]["forward"] == 1.0


@pytest.mark.parametrize(
    ("document", "fragment"),
    [
        ({"layers": []}, "non-empty list"),
        ({"layers": [{"forward": -1.0}]}, "forward=-1.0"),
        ({"layers": [{"forward": math.nan}]}, "forward=nan"),
        ({"layers": [{"forward": 1, "backwrd": 2}]}, "unknown keys ['backwrd']"),
        ({"layers": [{"backward": 1}]}, "lacks 'forward'"),
        ({"layers": [{"forward": 1}], "bandwidth": 0}, "bandwidth=0"),
        ({"layers": [{"forward": 1}, {"forward": 1}], "edges": [[0, 5, 1]]}, "endpoint 5"),
        ({"layers": [{"forward": 1}, {"forward": 1}], "edges": [[1, 0, 1]]}, "does not go forward"),
        ({"layers": [{"name": "x", "forward": 1}, {"name": "x", "forward": 1}]}, "duplicate"),
        ({"layers": [{"forward": 1}], "stages": 3}, "unknown top-level keys ['stages']"),
    ],
)
def test_json_errors_name_the_problem(document: dict, fragment: str) -> None:
    with pytest.raises(CostFileError) as raised:
        graph_from_json(document)
    assert fragment in str(raised.value)
    assert isinstance(raised.value, PartitionError) and isinstance(raised.value, ValueError)


def test_json_reports_every_problem_at_once() -> None:
    with pytest.raises(CostFileError) as raised:
        graph_from_json({"layers": [{"forward": -1}, {"forward": 1, "params": math.inf}]})
    assert len(raised.value.problems) == 2


def test_json_file_errors(tmp_path: Path) -> None:
    with pytest.raises(CostFileError, match="cannot read"):
        graph_from_json(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{"layers": [')
    with pytest.raises(CostFileError, match="not valid JSON at line 1"):
        graph_from_json(broken)


def test_negative_and_nan_costs_are_rejected_with_their_values() -> None:
    with pytest.raises(InvalidCostError, match=r"layer 'x' backward=-2"):
        LayerCost("x", forward=1.0, backward=-2.0)
    with pytest.raises(InvalidCostError, match="params=nan"):
        LayerCost("x", params=math.nan)
    with pytest.raises(InvalidCostError, match="bytes=-1"):
        ModelGraph([LayerCost("a"), LayerCost("b")], [(0, 1, -1.0)])


def test_from_digraph_orders_topologically_and_deterministically() -> None:
    digraph = nx.DiGraph()
    digraph.add_node("head", forward=1.0)
    digraph.add_node("embed", forward=2.0, params=8)
    digraph.add_node("body", forward=3.0)
    digraph.add_edge("embed", "body", bytes=4)
    digraph.add_edge("body", "head", bytes=4)
    graph = ModelGraph.from_digraph(digraph)
    assert graph.names == ("embed", "body", "head")
    digraph.add_edge("head", "embed")
    with pytest.raises(GraphError, match="cycle"):
        ModelGraph.from_digraph(digraph)


def residual_graph(skip: tuple[int, int]) -> ModelGraph:
    """Four unit layers in a chain (10 bytes per edge) plus a 100-byte skip edge."""
    layers = [LayerCost(f"l{i}", forward=1.0) for i in range(4)]
    edges = [(0, 1, 10.0), (1, 2, 10.0), (2, 3, 10.0), (*skip, 100.0)]
    return ModelGraph(layers, edges, bandwidth=1.0)


def test_skip_edge_crossing_a_cut_is_paid_by_both_stages() -> None:
    result = partition_graph(
        residual_graph((0, 3)), 2, method=Method.EXPLICIT, boundaries=(0, 2, 4)
    )
    assert result.comm == (110.0, 110.0)
    assert result.cost == (112.0, 112.0)


def test_balanced_avoids_cutting_a_skip_connection_when_it_pays() -> None:
    # Skip 1 -> 3: cutting after layer 0 crosses only 10 bytes; any other cut crosses 110.
    result = partition_graph(residual_graph((1, 3)), 2)
    assert result.boundaries == (0, 1, 4)
    assert result.bottleneck == 13.0


def test_edge_jumping_over_a_stage_costs_that_stage_nothing() -> None:
    layers = [LayerCost(f"l{i}", forward=1.0) for i in range(4)]
    edges = [(0, 1, 1.0), (1, 2, 1.0), (2, 3, 1.0), (0, 3, 50.0)]
    graph = ModelGraph(layers, edges, bandwidth=1.0)
    result = partition_graph(graph, 3, method=Method.EXPLICIT, boundaries=(0, 1, 3, 4))
    assert result.comm == (51.0, 2.0, 51.0)
    balanced = partition_graph(graph, 3)
    assert balanced.bottleneck == 52.0  # the skip crosses some cut in every 3-stage split


def test_chain_graph_from_plain_numbers() -> None:
    graph = chain_graph([1.0, 2.0, 3.0], edge_bytes=[5.0, 6.0], bandwidth=2.0)
    assert graph.names == ("layer0", "layer1", "layer2")
    result = partition_graph(graph, 2, method=Method.EXPLICIT, boundaries=(0, 2, 3))
    assert result.comm == (3.0, 3.0)
    with pytest.raises(InvalidCostError, match="edge_bytes has 1 entries"):
        chain_graph([1.0, 2.0, 3.0], edge_bytes=[1.0])


def test_bandwidth_argument_overrides_the_graph() -> None:
    graph = chain_graph([LayerCost("a", forward=1, activation=8), LayerCost("b", forward=1)])
    free = partition_graph(graph, 2)
    paid = partition_graph(graph, 2, bandwidth=4.0)
    assert free.comm == (0.0, 0.0) and paid.comm == (2.0, 2.0)
