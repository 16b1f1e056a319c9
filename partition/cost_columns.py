"""Read the layers and edges of a JSON cost file into columns, checking every value once.

A cost file of 100,000 layers is 500,000 numbers. Checking them one by one through a
`LayerCost` each (and again in the graph) took seconds; here one pass per field collects
the raw values, numpy checks each column in a single call, and only the values that fail
are looked at one by one to word their messages.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain
from typing import Any, NamedTuple

import numpy as np

from partition.checks import is_cost_number, shown_value

__all__ = ["LAYER_KEYS", "EdgeColumns", "LayerColumns", "read_edge_columns",
           "read_layer_columns"]

LAYER_KEYS = frozenset({"name", "forward", "backward", "params", "activation", "extra_memory",
                        "type"})
"""The keys a layer entry may have."""
_NUMERIC_KEYS = ("forward", "backward", "params", "activation", "extra_memory")
_MISSING = object()
_PLAIN_NUMBERS = frozenset({int, float})


class LayerColumns(NamedTuple):
    """The layers of a cost file as columns, in file order."""

    names: list[str]
    type_names: list[str]
    costs: dict[str, np.ndarray]
    """One float64 array per numeric key (the `COST_FIELDS` names)."""


def read_layer_columns(raw_layers: list[Any], problems: list[str]) -> LayerColumns:
    """Columns of `raw_layers`; every problem is appended to `problems`, in layer order and,
    within a layer, as: not an object, unknown keys, no 'forward', bad name or type, bad
    numbers (the numbers of an entry that is not an object or has a bad name are not read)."""
    n = len(raw_layers)
    found: list[tuple[int, int, str]] = []  # (layer, order within the layer, message)
    unusable: set[int] = set()
    entries: list[Mapping[str, Any]] = raw_layers
    if set(map(type, raw_layers)) != {dict}:
        entries = [raw if isinstance(raw, Mapping) else {} for raw in raw_layers]
        unusable = {index for index, raw in enumerate(raw_layers)
                    if not isinstance(raw, Mapping)}
        found += [(index, 0, f"layers[{index}] is {type(raw_layers[index]).__name__}, not an "
                             "object") for index in sorted(unusable)]
    present = set(chain.from_iterable(entries))  # every key used by some layer
    if not present <= LAYER_KEYS:
        for index, raw in enumerate(entries):
            unknown = sorted(map(str, set(raw) - LAYER_KEYS))
            if unknown:
                found.append((index, 1, f"layers[{index}] has unknown keys {unknown} "
                                        f"(allowed: {sorted(LAYER_KEYS)})"))
    names = _strings(entries, "name", present, found, unusable)
    type_names = _strings(entries, "type", present, found, unusable)
    costs: dict[str, np.ndarray] = {}
    for order, key in enumerate(_NUMERIC_KEYS, start=4):
        values = [raw.get(key, _MISSING) for raw in entries] if key in present else [_MISSING] * n
        costs[key], bad, missing = _as_floats(values)
        for index in bad:
            if index not in unusable:
                found.append((index, order, f"layers[{index}] ({names[index]!r}) "
                                            f"{key}={shown_value(values[index])} is not a "
                                            "finite number >= 0"))
        if key == "forward":  # the one required field
            found += [(index, 2, f"layers[{index}] lacks 'forward' (seconds)")
                      for index in missing if index not in unusable]
    problems.extend(message for _, _, message in sorted(found, key=lambda f: f[:2]))
    return LayerColumns(names, type_names, costs)


def _strings(entries: list[Mapping[str, Any]], key: str, present: set[str],
             found: list[tuple[int, int, str]], unusable: set[int]) -> list[str]:
    """The `key` column of strings: names default to ``layer<i>``, types to ""; an entry
    with a value that is not a string is reported and marked unusable."""
    default = "layer{}" if key == "name" else ""
    if key not in present:
        return [default.format(index) for index in range(len(entries))]
    values = [raw.get(key, _MISSING) for raw in entries]
    if set(map(type, values)) == {str}:
        return values
    for index, value in enumerate(values):
        if value is _MISSING:
            values[index] = default.format(index)
        elif type(value) is not str:
            if index not in unusable:
                found.append((index, 3, f"layers[{index}] 'name' and 'type' must be strings"))
            unusable.add(index)
            values[index] = str(value)
    return values


def _as_floats(values: list[Any]) -> tuple[np.ndarray, list[int], list[int]]:
    """The values as float64 (missing ones 0); the positions of those that are not a finite
    number >= 0 that a float holds (a bool, a string, None, a 400-digit integer); and the
    positions of the missing ones."""
    if _PLAIN_NUMBERS.issuperset(map(type, values)):  # the common case: one numpy call
        try:
            column = np.fromiter(values, np.float64, len(values))
        except OverflowError:  # an int beyond float range: fall through to one by one
            pass
        else:
            return column, np.flatnonzero(~(np.isfinite(column) & (column >= 0))).tolist(), []
    missing = [index for index, value in enumerate(values) if value is _MISSING]
    column = np.array([0.0 if value is _MISSING else float(value) if is_cost_number(value)
                       else np.nan for value in values], dtype=np.float64)
    bad = np.flatnonzero(np.isnan(column)).tolist()
    return column, bad, missing


class EdgeColumns(NamedTuple):
    """The usable edges of a cost file as columns, in file order."""

    sources: np.ndarray
    targets: np.ndarray
    sizes: np.ndarray


def read_edge_columns(raw_edges: list[Any], positions: Mapping[str, int], num_layers: int,
                      problems: list[str]) -> EdgeColumns:
    """Columns of the ``[from, to, bytes]`` triples; endpoints are layer names (looked up
    in `positions`) or indices. Problems are appended in edge order; an edge with any is
    left out (the caller raises when `problems` is not empty)."""
    found: list[tuple[int, int, str]] = []
    kept = list(range(len(raw_edges)))
    if not all(type(raw) is list and len(raw) == 3 for raw in raw_edges):
        kept = [index for index, raw in enumerate(raw_edges)
                if isinstance(raw, list) and len(raw) == 3]
        shaped = set(kept)
        found += [(index, 0, f"edges[{index}]={shown_value(raw)} is not a [from, to, bytes] "
                             "triple") for index, raw in enumerate(raw_edges)
                  if index not in shaped]
    triples = [raw_edges[index] for index in kept]
    columns = [list(column) for column in zip(*triples)] or [[], [], []]
    usable = np.ones(len(kept), dtype=bool)
    ends: list[np.ndarray] = []
    for order, values in enumerate(columns[:2], start=1):
        column, bad = _endpoints(values, positions, num_layers)
        for k in bad:
            found.append((kept[k], order, f"edges[{kept[k]}] endpoint {shown_value(values[k])} "
                                          "is neither a layer name nor an index in "
                                          f"0..{num_layers - 1}"))
        usable[bad] = False
        ends.append(column)
    sizes, bad, _ = _as_floats(columns[2])
    for k in bad:
        found.append((kept[k], 3, f"edges[{kept[k]}] bytes={shown_value(columns[2][k])} is not "
                                  "a finite number >= 0"))
    usable[bad] = False
    problems.extend(message for _, _, message in sorted(found, key=lambda f: f[:2]))
    return EdgeColumns(ends[0][usable], ends[1][usable], sizes[usable])


def _endpoints(values: list[Any], positions: Mapping[str, int],
               num_layers: int) -> tuple[np.ndarray, list[int]]:
    """Endpoints as layer positions (-1 where unusable), and the unusable ones' places."""
    if set(map(type, values)) <= {int}:  # indices only: one numpy call
        try:
            column = np.fromiter(values, np.int64, len(values))
        except OverflowError:  # an index beyond int64: fall through to one by one
            pass
        else:
            return column, np.flatnonzero((column < 0) | (column >= num_layers)).tolist()
    resolved = [positions.get(value, -1) if type(value) is str
                else value if type(value) is int and 0 <= value < num_layers else -1
                for value in values]
    column = np.array(resolved, dtype=np.int64)
    return column, np.flatnonzero(column < 0).tolist()
