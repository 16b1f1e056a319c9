"""Stage boundaries for a layer list: the call site of the `partition` package, nothing more.

The partitioner computes; this module only turns layers into the weights it takes. The
full `partition.partition_layers` entry point is used when it is available; until then the
exact min-max split `partition_weights` is fed per-layer weights computed here.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from pipeline.errors import PipelineConfigError
from pipeline.layers import Layer, count_parameters, layer_type_name

__all__ = ["PartitionMethod", "stage_boundaries"]

PartitionMethod = str | Sequence[int]
"""``"balanced"``, ``"uniform"``, ``"parameters"``, ``"type:<regex>"`` or explicit cut indices
(S+1 of them, first 0, last n)."""


def stage_boundaries(layers: Sequence[Layer], num_stages: int,
                     method: PartitionMethod) -> tuple[int, ...]:
    """The S+1 cut indices of `layers` into `num_stages` contiguous non-empty stages."""
    from partition.boundaries import uniform_boundaries, validate_boundaries
    from partition.errors import PartitionError
    from partition.methods import Method, parse_method

    n = len(layers)
    try:
        if not isinstance(method, str):
            return validate_boundaries(method, n, num_stages)
        kind, argument = parse_method(method)
        if kind is Method.EXPLICIT:
            raise PipelineConfigError(
                "partition_method='explicit' needs the cut indices themselves: pass e.g. "
                f"partition_method={list(uniform_boundaries(n, num_stages))}")
        if kind is Method.UNIFORM:
            return uniform_boundaries(n, num_stages)
        return _split_by_weights(_weights(layers, kind, argument), num_stages)
    except PartitionError as error:
        raise PipelineConfigError(f"cannot partition {n} layers into {num_stages} stages "
                                  f"with {method!r}: {error}") from error


def _weights(layers: Sequence[Layer], kind: object, argument: str | None) -> list[float]:
    from partition.methods import Method

    if kind is Method.TYPE:
        try:
            pattern = re.compile(argument or "", re.IGNORECASE)
        except re.error as error:
            raise PipelineConfigError(f"type:{argument} is not a valid regular expression "
                                      f"({error}); fix the pattern after 'type:'") from error
        weights = [1.0 if pattern.search(layer_type_name(layer)) else 0.0 for layer in layers]
        if not any(weights):
            names = sorted({layer_type_name(layer) for layer in layers})
            raise PipelineConfigError(
                f"no layer class matches type:{argument}; the layer classes are {names}")
        return weights
    # PARAMETERS, and BALANCED until the partitioner's profile-based entry point lands:
    # parameter counts are the cost proxy (per-layer FLOPs scale with them for a fixed
    # batch); the small constant keeps parameter-free layers from being free.
    counts = [float(count_parameters(layer)) for layer in layers]
    floor = 1e-3 * max(max(counts), 1.0) if kind is Method.BALANCED else 0.0
    return [count + floor for count in counts]


def _split_by_weights(weights: list[float], num_stages: int) -> tuple[int, ...]:
    from partition.bisection import partition_weights
    from partition.boundaries import check_stage_count

    check_stage_count(num_stages, len(weights))
    return tuple(int(cut) for cut in partition_weights(weights, num_stages))
