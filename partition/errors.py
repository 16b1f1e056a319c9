"""Typed errors raised by the partitioner, each naming the offending value and the fix."""

from __future__ import annotations

__all__ = [
    "CostFileError",
    "GraphError",
    "InfeasibleMemoryError",
    "InvalidBoundariesError",
    "InvalidCostError",
    "InvalidOptionError",
    "MemoryCapExceededError",
    "NoMatchingLayerError",
    "PartitionError",
    "ProfileError",
    "TooManyStagesError",
    "UnknownMethodError",
]


class PartitionError(ValueError):
    """Base class: a partitioning request that cannot be satisfied as given."""


class UnknownMethodError(PartitionError):
    """A method string that is not one of the allowed partition methods."""

    def __init__(self, text: str, allowed: tuple[str, ...], kind: str = "partition method") -> None:
        self.text = text
        self.allowed = allowed
        super().__init__(f"unknown {kind} {text!r}; use one of: {', '.join(allowed)}")


class TooManyStagesError(PartitionError):
    """More pipeline stages were requested than there are layers to place."""

    def __init__(self, num_stages: int, num_layers: int) -> None:
        self.num_stages = num_stages
        self.num_layers = num_layers
        super().__init__(
            f"cannot split {num_layers} layers into {num_stages} non-empty stages; "
            f"use at most {num_layers} stages or split the model into more layers"
        )


class InvalidCostError(PartitionError):
    """One or more layer or edge costs are negative, NaN or infinite."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = tuple(problems)
        listing = "; ".join(problems)
        super().__init__(
            f"invalid costs ({len(problems)} problem(s)): {listing}; "
            "costs must be finite and non-negative"
        )


class GraphError(PartitionError):
    """The model graph is malformed: duplicate names, unknown endpoints, cycles."""


class CostFileError(PartitionError):
    """A JSON cost file that does not follow the documented format."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = tuple(problems)
        listing = "; ".join(problems)
        super().__init__(
            f"{source}: {listing} (expected {{'layers': [{{'name', 'forward', 'backward', "
            f"'params', 'activation'}}, ...], 'edges': [[from, to, bytes], ...], "
            f"'bandwidth': bytes_per_s}})"
        )


class InvalidOptionError(PartitionError):
    """An option of the partition request is out of range or inconsistent."""


class InvalidBoundariesError(PartitionError):
    """Explicit stage boundaries that do not describe p contiguous non-empty stages."""

    def __init__(self, boundaries: tuple[int, ...], reason: str) -> None:
        self.boundaries = boundaries
        super().__init__(f"invalid stage boundaries {list(boundaries)}: {reason}")


class NoMatchingLayerError(PartitionError):
    """A `type:<regex>` method whose pattern matches no layer's class name."""

    def __init__(self, pattern: str, type_names: tuple[str, ...]) -> None:
        self.pattern = pattern
        self.type_names = type_names
        shown = ", ".join(type_names[:20]) + (", ..." if len(type_names) > 20 else "")
        super().__init__(f"type pattern {pattern!r} matches no layer; the layer types are: {shown}")


class InfeasibleMemoryError(PartitionError):
    """No contiguous partition into p stages fits under the per-stage memory cap."""

    def __init__(self, memory_cap: float, minimum_cap: float, num_stages: int) -> None:
        self.memory_cap = memory_cap
        self.minimum_cap = minimum_cap
        self.num_stages = num_stages
        super().__init__(
            f"memory cap {memory_cap:.6g} bytes is infeasible for {num_stages} stages: "
            f"the smallest cap any contiguous {num_stages}-stage partition fits under is "
            f"{minimum_cap:.6g} bytes; raise the cap to at least that, or use more stages"
        )


class ProfileError(PartitionError):
    """A layer could not be run forward and backward on the sample input."""


class MemoryCapExceededError(PartitionError):
    """Fixed boundaries (not `balanced`) put a stage over the per-stage memory cap."""

    def __init__(self, stage: int, memory: float, memory_cap: float) -> None:
        self.stage = stage
        self.memory = memory
        self.memory_cap = memory_cap
        super().__init__(
            f"stage {stage} needs {memory:.6g} bytes, over the memory cap of "
            f"{memory_cap:.6g} bytes; use the 'balanced' method, which respects the cap, "
            "or raise the cap"
        )
