"""partition_layers: boundaries for a runtime's list of layers, by method name or enum."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from partition.bisection import partition_weights
from partition.boundaries import check_stage_count, uniform_boundaries, validate_boundaries
from partition.errors import InvalidOptionError
from partition.layertypes import layer_type_name, trainable_parameter_count
from partition.methods import Method, match_types, parse_method

__all__ = ["partition_layers"]


def partition_layers(
    layers: Sequence[Any],
    num_stages: int,
    method: str | Method = Method.BALANCED,
    *,
    type_pattern: str | None = None,
    boundaries: Sequence[int] | None = None,
    weights: Sequence[float] | None = None,
    sample_input: Any = None,
) -> tuple[int, ...]:
    """The p + 1 stage boundaries (first 0, last n) for a sequence of layers.

    Layers may be modules, parameter-free callables or lazy layer specs. ``method`` is a
    `Method` or a string (``"uniform"``, ``"parameters"``, ``"type:<regex>"``,
    ``"explicit"``, ``"balanced"``):

    - UNIFORM: equal layer counts.
    - PARAMETERS: exact min-max split of ``weights`` if given (for unbuilt specs), else of
      each layer's trainable parameter count (0 without ``.parameters()``).
    - TYPE: min-max split of the count of layers whose class name matches the regex
      (from ``"type:<regex>"`` or ``type_pattern``), case-insensitively, as in DeepSpeed.
    - EXPLICIT: ``boundaries`` as given, validated.
    - BALANCED: exact min-max split of ``weights`` if given; else, with ``sample_input``,
      of each layer's profiled forward + backward time on that input (see
      `graph_from_layers`; needs torch); else of the proxy *trainable parameter count + 1*
      per layer (parameters stand in for compute, the +1 keeps parameter-free layers from
      piling up in one stage). For communication costs, memory caps or stage speeds, build
      a graph and call `partition_graph` instead.
    """
    if isinstance(method, str):
        method, parsed_pattern = parse_method(method)
        type_pattern = type_pattern if type_pattern is not None else parsed_pattern
    items = list(layers)
    num_stages = check_stage_count(num_stages, len(items))
    if weights is not None and len(weights) != len(items):
        raise InvalidOptionError(
            f"weights has {len(weights)} entries for {len(items)} layers; give one per layer"
        )
    if weights is not None and method not in (Method.PARAMETERS, Method.BALANCED):
        raise InvalidOptionError(
            f"weights only apply to the parameters and balanced methods, not {method.value}"
        )
    if boundaries is not None and method is not Method.EXPLICIT:
        raise InvalidOptionError(
            f"boundaries only apply to the explicit method, not {method.value}"
        )

    if method is Method.UNIFORM:
        return uniform_boundaries(len(items), num_stages)
    if method is Method.EXPLICIT:
        if boundaries is None:
            raise InvalidOptionError("the explicit method needs boundaries (p + 1 cut indices)")
        return validate_boundaries(boundaries, len(items), num_stages)
    if method is Method.TYPE:
        if not type_pattern:
            raise InvalidOptionError("the type method needs a regex: 'type:<regex>'")
        names = [layer_type_name(layer) for layer in items]
        return partition_weights(match_types(names, type_pattern), num_stages)
    if method is Method.PARAMETERS:
        counts = weights if weights is not None else [trainable_parameter_count(x) for x in items]
        return partition_weights(counts, num_stages)
    if weights is not None:
        return partition_weights(weights, num_stages)
    if sample_input is not None:
        from partition.partitioner import partition_graph
        from partition.torch_builders import graph_from_layers

        graph = graph_from_layers(items, sample_input)
        return partition_graph(graph, num_stages).boundaries
    proxy = [trainable_parameter_count(layer) + 1 for layer in items]
    return partition_weights(proxy, num_stages)
