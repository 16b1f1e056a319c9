"""Stage boundaries for a layer list: the call site of the `partition` package, nothing more.

The partitioner (`partition.partition_layers`) computes; this module only supplies what it
cannot know about a `LayerSpec` that is not built yet: its parameter count.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from pipeline.errors import PipelineConfigError
from pipeline.model.layers import Layer, count_parameters

__all__ = ["PartitionMethod", "stage_boundaries"]

PartitionMethod = str | Sequence[int]
"""``"balanced"``, ``"uniform"``, ``"parameters"``, ``"type:<regex>"`` or explicit cut indices
(S+1 of them, first 0, last n)."""


def stage_boundaries(layers: Sequence[Layer], num_stages: int,
                     method: PartitionMethod) -> tuple[int, ...]:
    """The S+1 cut indices of `layers` into `num_stages` contiguous non-empty stages."""
    from partition import Method, PartitionError, parse_method, partition_layers

    n = len(layers)
    cuts = None if isinstance(method, str) else _cut_indices(method)
    if not isinstance(method, str) and cuts is None:
        raise PipelineConfigError(
            f"partition_method must be 'parameters', 'uniform', 'balanced', 'type:<regex>' or "
            f"a list of cut indices such as [0, {n // 2}, {n}], got {method!r}")
    try:
        if not isinstance(method, str):
            return partition_layers(layers, num_stages, Method.EXPLICIT, boundaries=cuts)
        kind, pattern = parse_method(method)  # parsed once, here
        if kind is Method.EXPLICIT:
            raise PipelineConfigError(
                "partition_method='explicit' needs the cut indices themselves: pass e.g. "
                f"partition_method={list(partition_layers(layers, num_stages, 'uniform'))}")
        weights = None
        if kind in (Method.PARAMETERS, Method.BALANCED):
            # a LayerSpec is not built yet: count its parameters on the meta device. For
            # BALANCED without a profile the partitioner's proxy is parameters + 1 a layer.
            extra = 1.0 if kind is Method.BALANCED else 0.0
            weights = [count_parameters(layer) + extra for layer in layers]
        return partition_layers(layers, num_stages, kind, type_pattern=pattern, weights=weights)
    except PartitionError as error:
        raise PipelineConfigError(f"cannot partition {n} layers into {num_stages} stages "
                                  f"with {method!r}: {error}") from error


def _cut_indices(method: object) -> list[int] | None:
    """Explicit cuts as Python ints (numpy integers and arrays accepted), or None."""
    if isinstance(method, bytes) or not hasattr(method, "__iter__"):
        return None
    try:
        return [operator.index(cut) for cut in method]
    except TypeError:  # a float or anything else that is not an integer
        return None
