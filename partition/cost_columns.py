"""Read the ``layers`` of a JSON cost file into columns, checking every value once.

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

__all__ = ["LAYER_KEYS", "LayerColumns", "read_layer_columns"]

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
