"""Model graphs from plain numbers: a chain of layer costs, or a JSON cost file (no torch)."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping, Sequence
from typing import Any

from partition.checks import is_cost_number, shown_value
from partition.cost_columns import EdgeColumns, read_edge_columns, read_layer_columns
from partition.errors import CostFileError, InvalidCostError
from partition.graph import LayerCost, ModelGraph

__all__ = ["chain_graph", "graph_from_json"]

_TOP_KEYS = ("layers", "edges", "bandwidth")


def chain_graph(
    layer_costs: Sequence[LayerCost | float],
    *,
    edge_bytes: Sequence[float] | None = None,
    bandwidth: float | None = None,
) -> ModelGraph:
    """A chain i -> i+1 of layers.

    A plain number is a layer whose forward time is that number (and everything else 0),
    named ``layer<i>``. Edge i -> i+1 carries ``edge_bytes[i]`` bytes, by default layer
    i's activation bytes; with ``bandwidth`` None, communication is free.
    """
    layers = [
        cost if isinstance(cost, LayerCost) else LayerCost(f"layer{index}", forward=cost)
        for index, cost in enumerate(layer_costs)
    ]
    if not layers:
        raise InvalidCostError(["a chain needs at least one layer cost, got none"])
    if edge_bytes is None:
        edge_bytes = [layer.activation for layer in layers[:-1]]
    elif len(edge_bytes) != max(len(layers) - 1, 0):
        raise InvalidCostError(
            [
                f"edge_bytes has {len(edge_bytes)} entries for {len(layers)} layers "
                f"(give one per edge, {max(len(layers) - 1, 0)})"
            ]
        )
    edges = [(index, index + 1, size) for index, size in enumerate(edge_bytes)]
    return ModelGraph(layers, edges, bandwidth=bandwidth)


def graph_from_json(source: str | os.PathLike[str] | Mapping[str, Any]) -> ModelGraph:
    """Read the documented JSON cost format from a path or an already parsed mapping.

    ``{"layers": [{"name", "forward", "backward", "params", "activation"}, ...],
    "edges": [[from, to, bytes], ...], "bandwidth": bytes_per_s}``; times in seconds, sizes
    in bytes. Per layer only ``forward`` is required (the rest default to 0; optional
    ``extra_memory`` bytes and ``type`` class name). ``edges`` default to a chain whose
    edge i -> i+1 carries layer i's ``activation``; endpoints are layer indices or names.
    ``bandwidth`` defaults to free communication. All problems are reported at once.

    Each value is checked once: the layers are read into one column per field and the
    numbers checked with numpy, so 100,000 layers take a fraction of a second.
    """
    label, document = _load(source)
    if not isinstance(document, Mapping):
        raise CostFileError(label, [f"top level is {type(document).__name__}, not an object"])
    problems: list[str] = []
    unknown = sorted(map(str, set(document) - set(_TOP_KEYS)))
    if unknown:
        problems.append(f"unknown top-level keys {unknown}")
    raw_layers = document.get("layers")
    if not isinstance(raw_layers, list) or not raw_layers:
        raise CostFileError(label, [*problems, "'layers' must be a non-empty list"])
    columns = read_layer_columns(raw_layers, problems)
    bandwidth = _read_bandwidth(document.get("bandwidth"), problems)
    raw_edges = document.get("edges")
    edges: EdgeColumns | None = None
    if raw_edges is not None and not isinstance(raw_edges, list):
        problems.append(f"'edges' is {type(raw_edges).__name__}, not a list of triples")
    elif raw_edges is not None:
        positions = {name: index for index, name in enumerate(columns.names)}
        edges = read_edge_columns(raw_edges, positions, len(raw_layers), problems)
    if problems:
        raise CostFileError(label, problems)
    try:
        return ModelGraph.from_arrays(columns.names, columns.costs, edges,
                                      type_names=columns.type_names, bandwidth=bandwidth)
    except (InvalidCostError, ValueError) as error:
        raise CostFileError(label, [str(error)]) from error


def _load(source: str | os.PathLike[str] | Mapping[str, Any]) -> tuple[str, Any]:
    """The (label for messages, parsed document) of a path or mapping."""
    if isinstance(source, Mapping):
        return "cost document", source
    label = os.fspath(source)
    try:
        data = _read_regular_file(label)
    except OSError as error:
        raise CostFileError(label, [f"cannot read the file ({error.strerror})"]) from error
    try:
        return label, json.loads(data.decode("utf-8"))
    except json.JSONDecodeError as error:
        raise CostFileError(
            label, [f"not valid JSON at line {error.lineno} column {error.colno}: {error.msg}"]
        ) from error
    except UnicodeDecodeError as error:
        raise CostFileError(
            label, [f"not UTF-8 text (byte {error.start}: {error.reason}); save it as UTF-8 JSON"]
        ) from None
    except RecursionError:
        raise CostFileError(label, ["nested too deeply to be a cost file"]) from None
    except ValueError:  # json refuses integers of over 4,300 digits (int_max_str_digits)
        raise CostFileError(label, ["holds an integer too long to read (over 4,300 digits); "
                                    "costs must be finite numbers"]) from None


def _read_regular_file(path: str) -> bytes:
    """The bytes of `path`, refusing anything but a regular file: reading a named pipe
    would wait for a writer forever, a device may never end."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens without waiting
    mode = os.fstat(descriptor).st_mode
    if not stat.S_ISREG(mode):
        os.close(descriptor)
        kind = "a directory" if stat.S_ISDIR(mode) else "a named pipe (FIFO)" \
            if stat.S_ISFIFO(mode) else "a device or socket"
        raise CostFileError(path, [f"it is {kind}, not a regular file; save the costs to a "
                                   "JSON file and pass its path"])
    with os.fdopen(descriptor, "rb") as handle:
        return handle.read()


def _read_bandwidth(value: object, problems: list[str]) -> float | None:
    """The optional bandwidth in bytes per second."""
    if value is None:
        return None
    if not is_cost_number(value) or value == 0:
        problems.append(f"bandwidth={shown_value(value)} must be a number > 0 bytes/s, or "
                        "omitted")
        return None
    return float(value)
