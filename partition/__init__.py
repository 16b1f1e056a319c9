"""Split a model graph into optimally balanced pipeline stages (torch only for profiling)."""

from __future__ import annotations

from typing import Any

from partition.bisection import partition_weights
from partition.boundaries import uniform_boundaries, validate_boundaries
from partition.builders import chain_graph, graph_from_json
from partition.errors import (
    CostFileError,
    GraphError,
    InfeasibleMemoryError,
    InvalidBoundariesError,
    InvalidCostError,
    InvalidOptionError,
    MemoryCapExceededError,
    NoMatchingLayerError,
    PartitionError,
    ProfileError,
    TooManyStagesError,
    UnknownMethodError,
)
from partition.graph import Edge, LayerCost, ModelGraph
from partition.layers import partition_layers
from partition.methods import Method, ScheduleMemory, parse_method, parse_schedule_memory
from partition.partitioner import DEFAULT_OPTIMIZER_BYTES_PER_PARAM_BYTE, partition_graph
from partition.result import Partition

__all__ = [
    "DEFAULT_OPTIMIZER_BYTES_PER_PARAM_BYTE",
    "CostFileError",
    "Edge",
    "GraphError",
    "InfeasibleMemoryError",
    "InvalidBoundariesError",
    "InvalidCostError",
    "InvalidOptionError",
    "LayerCost",
    "MemoryCapExceededError",
    "Method",
    "ModelGraph",
    "NoMatchingLayerError",
    "Partition",
    "PartitionError",
    "ProfileError",
    "ScheduleMemory",
    "TooManyStagesError",
    "UnknownMethodError",
    "chain_graph",
    "graph_from_fx",
    "graph_from_json",
    "graph_from_layers",
    "parse_method",
    "parse_schedule_memory",
    "partition_graph",
    "partition_layers",
    "partition_weights",
    "uniform_boundaries",
    "validate_boundaries",
]

# The torch-based builders load on first use, so `import partition` never imports torch.
_LAZY = {
    "graph_from_fx": "partition.torch_builders",
    "graph_from_layers": "partition.torch_builders",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'partition' has no attribute {name!r}")
