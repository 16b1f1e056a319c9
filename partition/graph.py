"""The model graph: layers with costs in a fixed topological order, tensors with bytes as edges."""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import numpy as np

from partition.errors import GraphError, InvalidCostError

__all__ = ["COST_FIELDS", "Edge", "LayerCost", "ModelGraph"]

COST_FIELDS: tuple[str, ...] = ("forward", "backward", "params", "activation", "extra_memory")
"""The numeric per-layer attributes, in the units of `LayerCost`."""


def _bad_number(value: object) -> bool:
    """True for anything that is not a finite, non-negative real number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return True
    return not math.isfinite(value) or value < 0


@dataclass(frozen=True, slots=True)
class LayerCost:
    """One layer's measured or estimated costs; one microbatch unless stated otherwise."""

    name: str
    """Unique layer name (the node key in the graph)."""
    forward: float = 0.0
    """Forward time in seconds."""
    backward: float = 0.0
    """Backward time in seconds."""
    params: float = 0.0
    """Parameter bytes."""
    activation: float = 0.0
    """Bytes of the layer's output, held for the backward pass."""
    extra_memory: float = 0.0
    """Any further bytes the layer needs on its stage, once (workspace, buffers)."""
    type_name: str = ""
    """Class name, matched by the ``type:<regex>`` method."""

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise InvalidCostError(problems)

    def problems(self) -> list[str]:
        """Every field that is not a finite, non-negative number, as readable messages."""
        return [
            f"layer {self.name!r} {field}={getattr(self, field)!r}"
            for field in COST_FIELDS
            if _bad_number(getattr(self, field))
        ]

    @property
    def compute(self) -> float:
        """Forward plus backward time in seconds: the layer's share of a stage's time."""
        return self.forward + self.backward


@dataclass(frozen=True, slots=True)
class Edge:
    """A tensor from one layer to a later one, by position in the layer order."""

    source: int
    target: int
    bytes: float


class ModelGraph:
    """A DAG of layers in a fixed topological order.

    Positions in `layers` are what stage boundaries index; every edge goes from an earlier
    to a later position, so contiguous position ranges are valid pipeline stages. The
    networkx view (`digraph`) keys nodes by layer name with the `LayerCost` fields as node
    attributes and ``bytes`` on edges; it is built on first use, since the partitioner
    itself works on arrays.
    """

    def __init__(
        self,
        layers: Sequence[LayerCost],
        edges: Iterable[tuple[int, int, float]] = (),
        *,
        bandwidth: float | None = None,
    ) -> None:
        self._layers = tuple(layers)
        self._edges = tuple(Edge(int(s), int(t), b) for s, t, b in edges)
        self._bandwidth = bandwidth
        self._digraph: Any = None
        self._validate()
        self._arrays = {
            field: np.fromiter(
                (getattr(layer, field) for layer in self._layers),
                dtype=np.float64,
                count=len(self._layers),
            )
            for field in COST_FIELDS
        }
        for values in self._arrays.values():
            values.flags.writeable = False

    @classmethod
    def from_digraph(
        cls,
        digraph: Any,
        order: Sequence[Hashable] | None = None,
        *,
        bandwidth: float | None = None,
    ) -> ModelGraph:
        """Build from a networkx DiGraph whose nodes carry `COST_FIELDS` attributes (missing
        ones are 0, ``type_name`` optional) and whose edges carry ``bytes``.

        ``order`` fixes the layer order; without it the order is the topological sort that
        breaks ties by node insertion order, so it is deterministic.
        """
        if not nx.is_directed_acyclic_graph(digraph):
            cycle = nx.find_cycle(digraph)
            raise GraphError(f"the model graph has a cycle {cycle}; layers must form a DAG")
        if order is None:
            rank = {node: index for index, node in enumerate(digraph.nodes)}
            order = list(nx.lexicographical_topological_sort(digraph, key=rank.__getitem__))
        position = {node: index for index, node in enumerate(order)}
        if len(position) != digraph.number_of_nodes() or set(position) != set(digraph.nodes):
            raise GraphError(
                f"order lists {len(position)} distinct nodes but the graph has "
                f"{digraph.number_of_nodes()}; give every node exactly once"
            )
        layers = []
        for node in order:
            attributes = digraph.nodes[node]
            values = {field: attributes.get(field, 0.0) for field in COST_FIELDS}
            layers.append(_make_layer(str(node), values, str(attributes.get("type_name", ""))))
        edges = [
            (position[u], position[v], data.get("bytes", 0.0))
            for u, v, data in digraph.edges(data=True)
        ]
        return cls(layers, edges, bandwidth=bandwidth)

    def _validate(self) -> None:
        problems: list[str] = []
        for layer in self._layers:
            problems.extend(layer.problems())
        for edge in self._edges:
            if _bad_number(edge.bytes):
                problems.append(f"edge {edge.source}->{edge.target} bytes={edge.bytes!r}")
        if self._bandwidth is not None and (_bad_number(self._bandwidth) or self._bandwidth == 0):
            problems.append(f"bandwidth={self._bandwidth!r} (must be > 0, or None for free)")
        if problems:
            raise InvalidCostError(problems)
        names = [layer.name for layer in self._layers]
        if len(set(names)) != len(names):
            duplicates = sorted({name for name in names if names.count(name) > 1})
            raise GraphError(f"duplicate layer names {duplicates}; give each layer its own")
        n = len(self._layers)
        seen: set[tuple[int, int]] = set()
        for edge in self._edges:
            if not (0 <= edge.source < n and 0 <= edge.target < n):
                raise GraphError(
                    f"edge {edge.source}->{edge.target} names a layer outside 0..{n - 1}"
                )
            if edge.source >= edge.target:
                raise GraphError(
                    f"edge {names[edge.source]!r}->{names[edge.target]!r} "
                    f"({edge.source}->{edge.target}) does not go forward; list the layers "
                    "in a topological order (every producer before its consumers)"
                )
            if (edge.source, edge.target) in seen:
                raise GraphError(
                    f"edge {edge.source}->{edge.target} is given twice; merge it into one "
                    "edge carrying the summed bytes"
                )
            seen.add((edge.source, edge.target))

    @property
    def layers(self) -> tuple[LayerCost, ...]:
        """The layers in partition order."""
        return self._layers

    @property
    def edges(self) -> tuple[Edge, ...]:
        """The tensors between layers, by position."""
        return self._edges

    @property
    def bandwidth(self) -> float | None:
        """Bytes per second between stages; None means communication is free."""
        return self._bandwidth

    @property
    def num_layers(self) -> int:
        """How many layers (nodes) the graph has."""
        return len(self._layers)

    @property
    def names(self) -> tuple[str, ...]:
        """Layer names in partition order."""
        return tuple(layer.name for layer in self._layers)

    @property
    def is_chain(self) -> bool:
        """True when every edge joins neighbouring layers (i -> i+1)."""
        return all(edge.target == edge.source + 1 for edge in self._edges)

    def array(self, field: str) -> np.ndarray:
        """One `COST_FIELDS` attribute of every layer, as a read-only float64 array."""
        return self._arrays[field]

    @property
    def digraph(self) -> Any:
        """A frozen networkx DiGraph view: nodes by name with cost attributes, edges with
        ``bytes``."""
        if self._digraph is None:
            graph = nx.DiGraph()
            for layer in self._layers:
                attributes = {field: getattr(layer, field) for field in COST_FIELDS}
                graph.add_node(layer.name, type_name=layer.type_name, **attributes)
            for edge in self._edges:
                graph.add_edge(
                    self._layers[edge.source].name,
                    self._layers[edge.target].name,
                    bytes=edge.bytes,
                )
            self._digraph = nx.freeze(graph)
        return self._digraph

    def __repr__(self) -> str:
        kind = "chain" if self.is_chain else "DAG"
        return (
            f"ModelGraph({kind}, {self.num_layers} layers, {len(self._edges)} edges, "
            f"bandwidth={self._bandwidth})"
        )


def _make_layer(name: str, values: dict[str, Any], type_name: str) -> LayerCost:
    """A `LayerCost` from loosely typed values; bad numbers fail in `LayerCost`."""
    numbers = {
        field: float(value) if isinstance(value, int) and not isinstance(value, bool) else value
        for field, value in values.items()
    }
    return LayerCost(name=name, type_name=type_name, **numbers)
