"""The model graph: layers with costs in a fixed topological order, tensors with bytes as edges."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from partition.checks import bad_number, check_columns, cost_column, is_cost_number, shown_value
from partition.errors import GraphError, InvalidCostError

__all__ = ["COST_FIELDS", "Edge", "LayerCost", "ModelGraph"]

COST_FIELDS: tuple[str, ...] = ("forward", "backward", "params", "activation", "extra_memory")
"""The numeric per-layer attributes, in the units of `LayerCost`."""


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
            f"layer {self.name!r} {field}={shown_value(getattr(self, field))}"
            for field in COST_FIELDS
            if bad_number(getattr(self, field))
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
    to a later position, so contiguous position ranges are valid pipeline stages. The graph
    keeps its costs as columns (one float64 array per `COST_FIELDS` name, edges as three
    arrays), checked once, vectorised; `layers`, `edges` and the networkx view (`digraph`)
    are built on first use, since the partitioner itself works on the arrays.
    """

    def __init__(
        self,
        layers: Sequence[LayerCost],
        edges: Iterable[tuple[int, int, float]] = (),
        *,
        bandwidth: float | None = None,
    ) -> None:
        items = tuple(layers)
        edge_list = [tuple(edge) for edge in edges]
        problems = [
            f"edge {shown_value(edge[0])}->{shown_value(edge[1])} bytes={shown_value(edge[2])}"
            for edge in edge_list
            if len(edge) == 3 and bad_number(edge[2])
        ]
        if problems:
            raise InvalidCostError(problems)
        columns = {
            field: np.fromiter((getattr(layer, field) for layer in items), np.float64, len(items))
            for field in COST_FIELDS
        }
        try:
            endpoints = np.array([(int(s), int(t)) for s, t, _ in edge_list], dtype=np.int64)
        except OverflowError:
            raise GraphError("an edge names a layer position too large for any graph; edges "
                             "join layer positions 0..n-1") from None
        self._set(
            [layer.name for layer in items],
            [layer.type_name for layer in items],
            columns,
            endpoints.reshape(-1, 2),
            np.array([float(size) for _, _, size in edge_list], dtype=np.float64),
            bandwidth,
        )
        self._layers: tuple[LayerCost, ...] | None = items

    @classmethod
    def from_arrays(
        cls,
        names: Sequence[str],
        costs: Mapping[str, Any],
        edges: tuple[Any, Any, Any] | None = None,
        *,
        type_names: Sequence[str] | None = None,
        bandwidth: float | None = None,
    ) -> ModelGraph:
        """Build from columns: ``costs`` maps some `COST_FIELDS` names to one number per
        layer (arrays or lists; missing fields are 0); ``edges`` is (sources, targets, bytes),
        by default the chain i -> i+1 carrying layer i's activation. Checked at once with
        numpy, so 100,000 layers take milliseconds; raises `InvalidCostError` / `GraphError`.
        """
        n = len(names)
        unknown = sorted(set(costs) - set(COST_FIELDS))
        if unknown:
            raise GraphError(f"unknown cost fields {unknown}; use {list(COST_FIELDS)}")
        columns = {field: cost_column(costs.get(field), n, field) for field in COST_FIELDS}
        if edges is None:
            chain = np.arange(n - 1, dtype=np.int64)
            endpoints = np.stack([chain, chain + 1], axis=1)
            sizes = columns["activation"][:-1].copy()
        else:
            sources, targets, sizes_given = edges
            if not len(sources) == len(targets) == len(sizes_given):
                raise GraphError(f"edges give {len(sources)} sources, {len(targets)} targets "
                                 f"and {len(sizes_given)} byte counts; give one of each per edge")
            endpoints = np.stack([_positions(sources, "sources"), _positions(targets, "targets")],
                                 axis=1)
            sizes = cost_column(sizes_given, len(endpoints), "edge bytes")
        kinds = [""] * n if type_names is None else list(type_names)
        if len(kinds) != n:
            raise GraphError(f"type_names has {len(kinds)} entries for {n} layers")
        graph = cls.__new__(cls)
        graph._set(list(names), kinds, columns, endpoints, sizes, bandwidth)
        graph._layers = None
        return graph

    def _set(
        self,
        names: list[str],
        type_names: list[str],
        columns: dict[str, np.ndarray],
        endpoints: np.ndarray,
        sizes: np.ndarray,
        bandwidth: float | None,
    ) -> None:
        """Store the columns after `check_columns`; every constructor ends here."""
        check_columns(names, columns, endpoints, sizes, bandwidth)
        self._names = tuple(names)
        self._type_names = tuple(type_names)
        self._arrays = columns
        self._edge_source = np.ascontiguousarray(endpoints[:, 0])
        self._edge_target = np.ascontiguousarray(endpoints[:, 1])
        self._edge_bytes = sizes
        for values in (*columns.values(), self._edge_source, self._edge_target, sizes):
            values.flags.writeable = False
        self._bandwidth = bandwidth
        self._edges: tuple[Edge, ...] | None = None
        self._digraph: Any = None

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
        import networkx as nx  # loaded here: reading a cost file needs no networkx

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

    @property
    def layers(self) -> tuple[LayerCost, ...]:
        """The layers in partition order (made from the columns on first use)."""
        if self._layers is None:
            columns = [self._arrays[field].tolist() for field in COST_FIELDS]
            self._layers = tuple(
                LayerCost(name, *values, type_name=kind)  # type: ignore[misc]
                for name, kind, values in zip(self._names, self._type_names, zip(*columns))
            )
        return self._layers

    @property
    def edges(self) -> tuple[Edge, ...]:
        """The tensors between layers, by position."""
        if self._edges is None:
            self._edges = tuple(
                Edge(int(s), int(t), float(b))
                for s, t, b in zip(self._edge_source, self._edge_target, self._edge_bytes)
            )
        return self._edges

    @property
    def edge_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The edges as read-only (sources, targets, bytes) arrays, in `edges` order."""
        return self._edge_source, self._edge_target, self._edge_bytes

    @property
    def bandwidth(self) -> float | None:
        """Bytes per second between stages; None means communication is free."""
        return self._bandwidth

    @property
    def num_layers(self) -> int:
        """How many layers (nodes) the graph has."""
        return len(self._names)

    @property
    def names(self) -> tuple[str, ...]:
        """Layer names in partition order."""
        return self._names

    @property
    def type_names(self) -> tuple[str, ...]:
        """Layer class names in partition order ("" where unknown)."""
        return self._type_names

    @property
    def is_chain(self) -> bool:
        """True when every edge joins neighbouring layers (i -> i+1)."""
        return bool(np.all(self._edge_target == self._edge_source + 1))

    def array(self, field: str) -> np.ndarray:
        """One `COST_FIELDS` attribute of every layer, as a read-only float64 array."""
        return self._arrays[field]

    @property
    def digraph(self) -> Any:
        """A frozen networkx DiGraph view: nodes by name with cost attributes, edges with
        ``bytes``."""
        if self._digraph is None:
            import networkx as nx

            graph = nx.DiGraph()
            for layer in self.layers:
                attributes = {field: getattr(layer, field) for field in COST_FIELDS}
                graph.add_node(layer.name, type_name=layer.type_name, **attributes)
            for edge in self.edges:
                graph.add_edge(self._names[edge.source], self._names[edge.target],
                               bytes=edge.bytes)
            self._digraph = nx.freeze(graph)
        return self._digraph

    def __repr__(self) -> str:
        kind = "chain" if self.is_chain else "DAG"
        return (
            f"ModelGraph({kind}, {self.num_layers} layers, {len(self._edge_bytes)} edges, "
            f"bandwidth={self._bandwidth})"
        )


def _positions(values: Any, what: str) -> np.ndarray:
    """Edge endpoints as int64 layer positions; anything else is a `GraphError`."""
    try:
        positions = np.asarray(values)
    except (TypeError, ValueError, OverflowError):
        positions = np.asarray([], dtype=object)
    if positions.size and positions.dtype.kind not in "iu":
        raise GraphError(f"edge {what} must be integer layer positions, got {values!r:.60}")
    try:
        return positions.astype(np.int64).reshape(-1)
    except OverflowError:
        raise GraphError(f"edge {what} name a layer position too large for any graph") from None


def _make_layer(name: str, values: dict[str, Any], type_name: str) -> LayerCost:
    """A `LayerCost` from loosely typed values; bad numbers fail in `LayerCost`."""
    numbers = {  # ints become floats; one too large for a float stays as it is and fails
        field: float(value) if isinstance(value, int) and is_cost_number(value) else value
        for field, value in values.items()
    }
    return LayerCost(name=name, type_name=type_name, **numbers)
