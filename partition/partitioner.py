"""partition_graph: validate a request, choose boundaries by its method, report the costs."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from partition.balanced import solve_balanced
from partition.bisection import partition_weights
from partition.boundaries import check_stage_count, uniform_boundaries, validate_boundaries
from partition.errors import InvalidOptionError, MemoryCapExceededError
from partition.graph import ModelGraph
from partition.methods import (
    Method,
    ScheduleMemory,
    match_types,
    parse_method,
    parse_schedule_memory,
)
from partition.result import Partition
from partition.stage_costs import StageCosts, inflight_microbatches

__all__ = ["DEFAULT_OPTIMIZER_BYTES_PER_PARAM_BYTE", "partition_graph"]

DEFAULT_OPTIMIZER_BYTES_PER_PARAM_BYTE = 3.0
"""Training state per parameter byte besides the parameter: its gradient (1x) and Adam's
two moments (2x), all in the parameter's dtype."""


@dataclass(frozen=True)
class _Request:
    """A validated partition request; the method handlers read from it."""

    graph: ModelGraph
    num_stages: int
    method: Method
    type_pattern: str | None
    boundaries: tuple[int, ...] | None
    model: StageCosts


def _positive(value: object) -> bool:
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
        and float(value) > 0
    )


def _check_options(
    method: Method,
    num_stages: int,
    type_pattern: str | None,
    boundaries: Sequence[int] | None,
    memory_cap: float | None,
    speeds: Sequence[float] | None,
    num_microbatches: int | None,
    bandwidth: float | None,
    optimizer_bytes_per_param_byte: float,
) -> None:
    """Collect every inconsistent or out-of-range option and raise once."""
    problems = []
    if method is Method.TYPE and not type_pattern:
        problems.append("method TYPE needs type_pattern, a regex over layer class names")
    if method is not Method.TYPE and type_pattern is not None:
        problems.append(f"type_pattern={type_pattern!r} only applies to method TYPE")
    if method is Method.EXPLICIT and boundaries is None:
        problems.append("method EXPLICIT needs boundaries (p + 1 cut indices, 0 .. n)")
    if method is not Method.EXPLICIT and boundaries is not None:
        problems.append(f"boundaries={list(boundaries)} only apply to method EXPLICIT")
    if memory_cap is not None and not _positive(memory_cap):
        problems.append(f"memory_cap={memory_cap!r} must be a positive number of bytes")
    if speeds is not None:
        if len(speeds) != num_stages:
            problems.append(f"speeds has {len(speeds)} entries for {num_stages} stages")
        bad = [speed for speed in speeds if not _positive(speed)]
        if bad:
            problems.append(f"speeds {bad} must be positive, finite factors")
    if num_microbatches is not None and (
        isinstance(num_microbatches, bool)
        or not isinstance(num_microbatches, numbers.Integral)
        or num_microbatches < 1
    ):
        problems.append(f"num_microbatches={num_microbatches!r} must be an integer >= 1")
    if bandwidth is not None and not _positive(bandwidth):
        problems.append(f"bandwidth={bandwidth!r} must be positive bytes/s, or None")
    if not (
        isinstance(optimizer_bytes_per_param_byte, numbers.Real)
        and math.isfinite(float(optimizer_bytes_per_param_byte))
        and optimizer_bytes_per_param_byte >= 0
    ):
        problems.append(
            f"optimizer_bytes_per_param_byte={optimizer_bytes_per_param_byte!r} must be >= 0"
        )
    if problems:
        raise InvalidOptionError("; ".join(problems))


def _type_names(graph: ModelGraph) -> list[str]:
    """Class names to match, falling back to the layer name when a layer has no type."""
    return [kind or name for kind, name in zip(graph.type_names, graph.names)]


def _uniform(request: _Request) -> tuple[int, ...]:
    return uniform_boundaries(request.graph.num_layers, request.num_stages)


def _parameters(request: _Request) -> tuple[int, ...]:
    return partition_weights(request.graph.array("params"), request.num_stages)


def _by_type(request: _Request) -> tuple[int, ...]:
    weights = match_types(_type_names(request.graph), request.type_pattern or "")
    return partition_weights(weights, request.num_stages)


def _explicit(request: _Request) -> tuple[int, ...]:
    return validate_boundaries(
        request.boundaries or (), request.graph.num_layers, request.num_stages
    )


def _balanced(request: _Request) -> tuple[int, ...]:
    return solve_balanced(request.model)


_HANDLERS: dict[Method, Callable[[_Request], tuple[int, ...]]] = {
    Method.UNIFORM: _uniform,
    Method.PARAMETERS: _parameters,
    Method.TYPE: _by_type,
    Method.EXPLICIT: _explicit,
    Method.BALANCED: _balanced,
}


def partition_graph(
    graph: ModelGraph,
    num_stages: int,
    *,
    method: Method | str = Method.BALANCED,
    type_pattern: str | None = None,
    boundaries: Sequence[int] | None = None,
    memory_cap: float | None = None,
    speeds: Sequence[float] | None = None,
    num_microbatches: int | None = None,
    schedule_memory: ScheduleMemory | str = ScheduleMemory.ONE_F_ONE_B,
    bandwidth: float | None = None,
    optimizer_bytes_per_param_byte: float = DEFAULT_OPTIMIZER_BYTES_PER_PARAM_BYTE,
) -> Partition:
    """Split ``graph`` into ``num_stages`` contiguous stages of its layer order.

    ``method`` BALANCED (default) minimises the slowest stage's time (compute / speed +
    communication across its cuts) subject to ``memory_cap`` bytes per stage, exactly;
    UNIFORM, PARAMETERS, TYPE (with ``type_pattern``) and EXPLICIT (with ``boundaries``)
    fix the boundaries otherwise and only report the costs (raising if a stage exceeds the
    cap). A string method is parsed with `parse_method`.

    ``speeds`` gives each stage's relative speed (default all 1). Memory counts parameters
    times (1 + ``optimizer_bytes_per_param_byte``), extra memory, and the activations of
    the microbatches held under ``schedule_memory`` with ``num_microbatches`` (default p):
    1F1B stage k holds min(p - k, m), GPipe holds m. ``bandwidth`` (bytes/s) overrides the
    graph's; without either, communication is free.
    """
    # Step 1: validate everything before any work.
    if not isinstance(graph, ModelGraph):
        raise InvalidOptionError(f"graph must be a partition.ModelGraph (from chain_graph, "
                                 f"graph_from_json or graph_from_layers), got {graph!r}")
    if isinstance(method, str):
        method, parsed_pattern = parse_method(method)
        type_pattern = type_pattern if type_pattern is not None else parsed_pattern
    num_stages = check_stage_count(num_stages, graph.num_layers)
    _check_options(
        method,
        num_stages,
        type_pattern,
        boundaries,
        memory_cap,
        speeds,
        num_microbatches,
        bandwidth,
        optimizer_bytes_per_param_byte,
    )
    schedule = parse_schedule_memory(schedule_memory)

    # Step 2: the cost model every method is judged by.
    microbatches = num_stages if num_microbatches is None else int(num_microbatches)
    model = StageCosts(
        graph,
        speeds=[float(speed) for speed in speeds] if speeds is not None else [1.0] * num_stages,
        inflight=inflight_microbatches(schedule, num_stages, microbatches),
        optimizer_bytes_per_param_byte=float(optimizer_bytes_per_param_byte),
        bandwidth=float(bandwidth) if bandwidth is not None else graph.bandwidth,
        memory_cap=float(memory_cap) if memory_cap is not None else None,
    )
    request = _Request(
        graph,
        num_stages,
        method,
        type_pattern,
        tuple(boundaries) if boundaries is not None else None,
        model,
    )

    # Step 3: the method picks the boundaries.
    cuts = _HANDLERS[method](request)

    # Step 4: report; fixed methods are only checked against the cap, not fitted to it.
    compute, comm, memory = model.evaluate(cuts)
    if memory_cap is not None and method is not Method.BALANCED:
        worst = int(memory.argmax())
        if memory[worst] > memory_cap:
            raise MemoryCapExceededError(worst, float(memory[worst]), float(memory_cap))
    return Partition(
        boundaries=cuts,
        compute=tuple(float(value) for value in compute),
        comm=tuple(float(value) for value in comm),
        memory=tuple(float(value) for value in memory),
        method=method,
        layer_names=graph.names,
        memory_cap=float(memory_cap) if memory_cap is not None else None,
    )
