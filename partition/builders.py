"""Model graphs from plain numbers: a chain of layer costs, or a JSON cost file (no torch)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

from partition.errors import CostFileError, InvalidCostError
from partition.graph import LayerCost, ModelGraph

__all__ = ["chain_graph", "graph_from_json"]

_LAYER_KEYS = {
    "name": "name",
    "forward": "forward",
    "backward": "backward",
    "params": "params",
    "activation": "activation",
    "extra_memory": "extra_memory",
    "type": "type_name",
}
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
    """
    label, document = _load(source)
    problems: list[str] = []
    if not isinstance(document, Mapping):
        raise CostFileError(label, [f"top level is {type(document).__name__}, not an object"])
    unknown = sorted(set(document) - set(_TOP_KEYS))
    if unknown:
        problems.append(f"unknown top-level keys {unknown}")
    raw_layers = document.get("layers")
    if not isinstance(raw_layers, list) or not raw_layers:
        raise CostFileError(label, [*problems, "'layers' must be a non-empty list"])
    layers = [_read_layer(index, raw, problems) for index, raw in enumerate(raw_layers)]
    names = {layer.name: index for index, layer in enumerate(layers) if layer is not None}
    bandwidth = _read_bandwidth(document.get("bandwidth"), problems)
    raw_edges = document.get("edges")
    edges: list[tuple[int, int, float]] = []
    if raw_edges is None:
        edges = [
            (index, index + 1, layer.activation)
            for index, layer in enumerate(layers[:-1])
            if layer is not None
        ]
    elif not isinstance(raw_edges, list):
        problems.append(f"'edges' is {type(raw_edges).__name__}, not a list of triples")
    else:
        for position, raw in enumerate(raw_edges):
            edge = _read_edge(position, raw, names, len(layers), problems)
            if edge is not None:
                edges.append(edge)
    if problems:
        raise CostFileError(label, problems)
    complete = [layer for layer in layers if layer is not None]
    try:
        return ModelGraph(complete, edges, bandwidth=bandwidth)
    except (InvalidCostError, ValueError) as error:
        raise CostFileError(label, [str(error)]) from error


def _load(source: str | os.PathLike[str] | Mapping[str, Any]) -> tuple[str, Any]:
    """The (label for messages, parsed document) of a path or mapping."""
    if isinstance(source, Mapping):
        return "cost document", source
    label = os.fspath(source)
    try:
        with open(label, encoding="utf-8") as handle:
            return label, json.load(handle)
    except OSError as error:
        raise CostFileError(label, [f"cannot read the file ({error.strerror})"]) from error
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


def _is_number(value: object) -> TypeGuard[float]:
    """True for int or float values that are not bools."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _read_layer(index: int, raw: object, problems: list[str]) -> LayerCost | None:
    """One layer entry, or None after recording why it is unusable."""
    where = f"layers[{index}]"
    if not isinstance(raw, Mapping):
        problems.append(f"{where} is {type(raw).__name__}, not an object")
        return None
    unknown = sorted(set(raw) - set(_LAYER_KEYS))
    if unknown:
        problems.append(f"{where} has unknown keys {unknown} (allowed: {sorted(_LAYER_KEYS)})")
    if "forward" not in raw:
        problems.append(f"{where} lacks 'forward' (seconds)")
    name = raw.get("name", f"layer{index}")
    type_name = raw.get("type", "")
    if not isinstance(name, str) or not isinstance(type_name, str):
        problems.append(f"{where} 'name' and 'type' must be strings")
        return None
    values: dict[str, float] = {}
    for key in ("forward", "backward", "params", "activation", "extra_memory"):
        value = raw.get(key, 0.0)
        if not _is_number(value) or not math.isfinite(value) or value < 0:
            problems.append(f"{where} ({name!r}) {key}={value!r} is not a finite number >= 0")
            continue
        values[_LAYER_KEYS[key]] = float(value)
    if len(values) < 5:
        return None
    return LayerCost(name=name, type_name=type_name, **values)


def _read_edge(
    position: int,
    raw: object,
    names: Mapping[str, int],
    num_layers: int,
    problems: list[str],
) -> tuple[int, int, float] | None:
    """One ``[from, to, bytes]`` triple with endpoints resolved to indices."""
    where = f"edges[{position}]"
    if not isinstance(raw, list) or len(raw) != 3:
        problems.append(f"{where}={raw!r} is not a [from, to, bytes] triple")
        return None
    endpoints: list[int] = []
    for end in raw[:2]:
        if isinstance(end, str) and end in names:
            endpoints.append(names[end])
        elif isinstance(end, int) and not isinstance(end, bool) and 0 <= end < num_layers:
            endpoints.append(end)
        else:
            problems.append(
                f"{where} endpoint {end!r} is neither a layer name nor an index in "
                f"0..{num_layers - 1}"
            )
    size = raw[2]
    if not _is_number(size) or not math.isfinite(size) or size < 0:
        problems.append(f"{where} bytes={size!r} is not a finite number >= 0")
        return None
    if len(endpoints) != 2:
        return None
    return endpoints[0], endpoints[1], float(size)


def _read_bandwidth(value: object, problems: list[str]) -> float | None:
    """The optional bandwidth in bytes per second."""
    if value is None:
        return None
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        problems.append(f"bandwidth={value!r} must be a number > 0 bytes/s, or omitted")
        return None
    return float(value)
