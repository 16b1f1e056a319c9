"""Reading cost files: regressions of issue 16 (item 7) and the column reader of issue 12.

The column reader checks each value once with numpy; the properties below pin it to what
a graph built layer by layer from `LayerCost` values holds.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partition import (
    CostFileError,
    GraphError,
    InvalidCostError,
    LayerCost,
    ModelGraph,
    graph_from_json,
    partition_graph,
)
from partition.graph import COST_FIELDS

BIG = 10**400  # json reads it as an int; float(BIG) raises OverflowError


def returns_promptly(call: Callable[[], object], fifo: Path) -> BaseException | None:
    """Run `call` in a thread; if it blocks (opening the FIFO), unblock it and fail."""
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as error:  # handed to the test to check
            outcome.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout=60)
    if thread.is_alive():  # the bug: open() waits for a writer; be that writer, then fail
        with open(fifo, "wb"):
            pass
        thread.join(timeout=10)
        pytest.fail(f"blocked on the FIFO {fifo}")
    return outcome[0]


@pytest.mark.parametrize(("document", "fragment"), [
    ({"layers": [{"forward": BIG}]}, "forward=(an integer of about 401 digits)"),
    ({"layers": [{"forward": 1, "params": BIG}]}, "params=(an integer of about 401 digits)"),
    ({"layers": [{"forward": 1}, {"forward": 1}], "edges": [[0, 1, BIG]]}, "edges[0] bytes="),
    ({"layers": [{"forward": 1}], "bandwidth": BIG}, "bandwidth=(an integer of about 401"),
])
def test_a_400_digit_integer_cost_is_a_cost_file_error_not_overflow(
        tmp_path: Path, document: dict[str, object], fragment: str) -> None:
    # Was: OverflowError: int too large to convert to float.
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(document))
    with pytest.raises(CostFileError) as raised:
        graph_from_json(path)
    assert fragment in str(raised.value)
    assert len(str(raised.value)) < 600  # the number is described, not printed


def test_an_integer_too_long_for_json_is_a_cost_file_error(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    path.write_text('{"layers": [{"forward": ' + "7" * 5000 + "}]}")
    with pytest.raises(CostFileError, match="integer too long to read"):
        graph_from_json(path)


def test_a_400_digit_integer_is_a_typed_error_in_every_constructor() -> None:
    with pytest.raises(InvalidCostError, match="about 401 digits"):
        LayerCost("x", forward=BIG)
    with pytest.raises(InvalidCostError, match="bytes="):
        ModelGraph([LayerCost("a"), LayerCost("b")], [(0, 1, BIG)])
    with pytest.raises(InvalidCostError, match="bandwidth="):
        ModelGraph([LayerCost("a")], bandwidth=BIG)
    digraph = nx.DiGraph()
    digraph.add_node("a", forward=BIG)
    with pytest.raises(InvalidCostError, match="about 401 digits"):
        ModelGraph.from_digraph(digraph)
    with pytest.raises(InvalidCostError, match="forward"):
        ModelGraph.from_arrays(["a"], {"forward": [BIG]})


def test_a_fifo_as_cost_file_is_refused_not_waited_on(tmp_path: Path) -> None:
    # Was: graph_from_json opened the FIFO and waited for a writer forever.
    fifo = tmp_path / "costs.json"
    os.mkfifo(fifo)
    error = returns_promptly(lambda: graph_from_json(fifo), fifo)
    assert isinstance(error, CostFileError) and "named pipe (FIFO)" in str(error)


def test_a_directory_as_cost_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CostFileError, match="it is a directory, not a regular file"):
        graph_from_json(tmp_path)


def test_problems_are_listed_in_layer_order() -> None:
    with pytest.raises(CostFileError) as raised:
        graph_from_json({"layers": [{"forward": 1, "params": -1}, {"backward": 1, "x": 0},
                                    7, {"forward": "2", "name": 3}, {"forward": True}]})
    assert [problem.split(" ")[0] for problem in raised.value.problems] == [
        "layers[0]", "layers[1]", "layers[1]", "layers[2]", "layers[3]", "layers[4]"]
    assert "unknown keys ['x']" in raised.value.problems[1]
    assert "lacks 'forward'" in raised.value.problems[2]
    assert "forward=True" in raised.value.problems[5]


def test_from_arrays_refuses_what_the_layer_constructor_refuses() -> None:
    with pytest.raises(InvalidCostError, match=r"layer 'b' backward=-1\.0"):
        ModelGraph.from_arrays(["a", "b"], {"forward": [1, 1], "backward": [0, -1]})
    with pytest.raises(GraphError, match="duplicate layer names \\['a'\\]"):
        ModelGraph.from_arrays(["a", "a"], {"forward": [1, 1]})
    with pytest.raises(GraphError, match="forward has 1 values for 2 layers"):
        ModelGraph.from_arrays(["a", "b"], {"forward": [1]})
    with pytest.raises(GraphError, match=r"edge 'b'->'a' \(1->0\) does not go forward"):
        ModelGraph.from_arrays(["a", "b"], {"forward": [1, 1]}, ([1], [0], [1.0]))
    with pytest.raises(GraphError, match="edge 0->1 is given twice"):
        ModelGraph.from_arrays(["a", "b"], {"forward": [1, 1]}, ([0, 0], [1, 1], [1.0, 2.0]))
    with pytest.raises(GraphError, match=r"outside 0\.\.1"):
        ModelGraph.from_arrays(["a", "b"], {"forward": [1, 1]}, ([0], [2], [1.0]))
    with pytest.raises(GraphError, match="1 sources, 2 targets and 1 byte counts"):
        ModelGraph.from_arrays(["a", "b"], {"forward": [1, 1]}, ([0], [1, 1], [1.0]))
    with pytest.raises(GraphError, match="must be integer layer positions"):
        ModelGraph.from_arrays(["a", "b"], {"forward": [1, 1]}, ([0.5], [1], [1.0]))
    with pytest.raises(GraphError, match="type_names has 1 entries for 2 layers"):
        ModelGraph.from_arrays(["a", "b"], {"forward": [1, 1]}, type_names=["Block"])


costs = st.floats(0, 1e6, allow_nan=False) | st.integers(0, 10**6)
layer_entries = st.fixed_dictionaries({"forward": costs}, optional={
    "backward": costs, "params": costs, "activation": costs, "extra_memory": costs,
    "type": st.sampled_from(["Block", "Embedding", ""])})


@settings(max_examples=40)
@given(st.lists(layer_entries, min_size=1, max_size=12), st.booleans(),
       st.none() | st.floats(1.0, 1e12))
def test_the_column_reader_builds_the_graph_layer_by_layer_costs_would(
        entries: list[dict[str, Any]], skip: bool, bandwidth: float | None) -> None:
    n = len(entries)
    edges = [[i, i + 1, 8.0 * i] for i in range(n - 1)] + (
        [[0, n - 1, 3.0]] if skip and n > 2 else [])
    document: dict[str, object] = {"layers": entries, "edges": edges}
    if bandwidth is not None:
        document["bandwidth"] = bandwidth
    read = graph_from_json(document)
    layers = [LayerCost(f"layer{i}", type_name=str(entry.get("type", "")),
                        **{k: float(v) for k, v in entry.items() if k in COST_FIELDS})
              for i, entry in enumerate(entries)]
    built = ModelGraph(layers, [(int(s), int(t), float(b)) for s, t, b in edges],
                       bandwidth=bandwidth)
    assert read.names == built.names and read.layers == built.layers
    assert read.edges == built.edges and read.is_chain == built.is_chain
    for field in COST_FIELDS:
        assert np.array_equal(read.array(field), built.array(field))
    stages = min(3, n)
    assert partition_graph(read, stages) == partition_graph(built, stages)


def test_a_chain_by_default_carries_each_layers_activation() -> None:
    graph = ModelGraph.from_arrays(["a", "b", "c"], {"forward": [1, 2, 3],
                                                     "activation": [5, 7, math.pi]})
    assert [(e.source, e.target, e.bytes) for e in graph.edges] == [(0, 1, 5.0), (1, 2, 7.0)]
    assert graph.is_chain and graph.type_names == ("", "", "")


@pytest.mark.parametrize(("options", "what"), [
    ({}, "compute time"),
    ({"speeds": [1.0, 1e-308]}, "compute time"),
    ({"bandwidth": 1e-320}, "communication time"),
])
def test_finite_costs_whose_sums_overflow_are_refused_not_an_internal_error(
        options: dict[str, object], what: str) -> None:
    # Was: "max() arg is an empty sequence" after numpy overflow warnings.
    graph = ModelGraph.from_arrays(
        ["a", "b", "c"], {"forward": [1e308, 1e308, 1.0] if not options else [1.0, 1.0, 1.0],
                          "activation": [8.0, 8.0, 8.0]})
    with pytest.raises(InvalidCostError, match=f"{what} .* past the largest float"):
        partition_graph(graph, 2, **options)  # type: ignore[arg-type]
