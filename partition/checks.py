"""Checks of cost values shared by the graph and its readers: numbers, columns, edges."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, TypeGuard

import numpy as np

from partition.errors import GraphError, InvalidCostError

__all__ = ["bad_number", "check_columns", "cost_column", "is_cost_number", "shown_value"]


def bad_number(value: object) -> bool:
    """True for anything that is not a finite, non-negative real number (an int too large
    for a float included: it would overflow every sum it enters)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return True
    try:
        return not math.isfinite(value) or value < 0
    except OverflowError:
        return True


def is_cost_number(value: object) -> TypeGuard[int | float]:
    """True for a finite, non-negative int or float that a float can hold (not a bool)."""
    return not bad_number(value)


def shown_value(value: object) -> str:
    """`repr(value)` for messages, shortened when it is too long (a 400-digit integer)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"(an integer of about {int(value.bit_length() * 0.30103) + 1} digits)"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}...{text[-10:]}"


def cost_column(values: Any, n: int, field: str) -> np.ndarray:
    """One cost field as a fresh float64 array of n values (zeros when None)."""
    if values is None:
        return np.zeros(n)
    try:
        column = np.array(values, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError, OverflowError) as error:
        raise InvalidCostError([f"{field} is not a list of numbers ({error})"]) from None
    if len(column) != n:
        raise GraphError(f"{field} has {len(column)} values for {n} layers; give one per layer")
    return column


def check_columns(
    names: list[str],
    columns: dict[str, np.ndarray],
    endpoints: np.ndarray,
    sizes: np.ndarray,
    bandwidth: float | None,
) -> None:
    """Every check of a graph, once, on whole arrays: costs finite and >= 0, names unique,
    edges in range, forward and not repeated. Raises `InvalidCostError` or `GraphError`."""
    problems: list[str] = []
    for field, values in columns.items():
        for index in np.flatnonzero(~(np.isfinite(values) & (values >= 0))).tolist():
            problems.append(f"layer {names[index]!r} {field}={float(values[index])!r}")
    for index in np.flatnonzero(~(np.isfinite(sizes) & (sizes >= 0))).tolist():
        source, target = endpoints[index].tolist()
        problems.append(f"edge {source}->{target} bytes={float(sizes[index])!r}")
    if bandwidth is not None and (bad_number(bandwidth) or bandwidth == 0):
        problems.append(f"bandwidth={shown_value(bandwidth)} (must be > 0, or None for free)")
    if problems:
        raise InvalidCostError(problems)
    if len(set(names)) != len(names):
        duplicates = sorted(name for name, count in Counter(names).items() if count > 1)
        raise GraphError(f"duplicate layer names {duplicates[:20]}; give each layer its own")
    n = len(names)
    sources, targets = endpoints[:, 0], endpoints[:, 1]
    outside = np.flatnonzero((sources < 0) | (sources >= n) | (targets < 0) | (targets >= n))
    if outside.size:
        source, target = endpoints[outside[0]].tolist()
        raise GraphError(f"edge {source}->{target} names a layer outside 0..{n - 1}")
    backward = np.flatnonzero(sources >= targets)
    if backward.size:
        source, target = endpoints[backward[0]].tolist()
        raise GraphError(
            f"edge {names[source]!r}->{names[target]!r} ({source}->{target}) does not go "
            "forward; list the layers in a topological order (every producer before its "
            "consumers)"
        )
    keys = sources * n + targets  # unique per (source, target): both are in 0..n-1
    order = np.argsort(keys, kind="stable")
    repeated = np.flatnonzero(keys[order][1:] == keys[order][:-1])
    if repeated.size:
        source, target = endpoints[order[repeated.min() + 1]].tolist()
        raise GraphError(
            f"edge {source}->{target} is given twice; merge it into one edge carrying the "
            "summed bytes"
        )
