"""Stage time and memory of any boundaries: the arrays every method and solver shares."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from partition.graph import ModelGraph
from partition.methods import ScheduleMemory

__all__ = ["CostModel", "inflight_microbatches"]

# Legend: n layers, p stages, m microbatches; stage k (0-based) covers layers [b_k, b_{k+1}).
#   compute_k = sum(forward + backward) / speed_k                     (seconds)
#   comm_k    = sum over edges with exactly one end in stage k of bytes / bandwidth
#   memory_k  = sum(params) * (1 + optimizer_factor) + sum(extra_memory)
#             + inflight_k * sum(activation)                          (bytes)
# Activation bytes are per microbatch; inflight_k is how many microbatches' activations
# stage k holds at its peak under the schedule.


def inflight_microbatches(
    schedule: ScheduleMemory, num_stages: int, num_microbatches: int
) -> tuple[int, ...]:
    """Microbatches each stage holds at its peak: 1F1B warms stage k up with p - k forwards
    before its first backward (Narayanan et al., PipeDream-Flush, 2021), GPipe runs all m."""
    if schedule is ScheduleMemory.GPIPE:
        return (num_microbatches,) * num_stages
    return tuple(min(num_stages - stage, num_microbatches) for stage in range(num_stages))


def _prefix(values: np.ndarray) -> np.ndarray:
    return np.concatenate(([0.0], np.cumsum(values)))


class CostModel:
    """Prefix sums and per-stage factors of one graph under one set of options."""

    def __init__(
        self,
        graph: ModelGraph,
        *,
        speeds: Sequence[float],
        inflight: Sequence[int],
        optimizer_bytes_per_param_byte: float,
        bandwidth: float | None,
        memory_cap: float | None,
    ) -> None:
        self.num_layers = graph.num_layers
        self.num_stages = len(speeds)
        self.speeds = np.asarray(speeds, dtype=np.float64)
        self.inflight = np.asarray(inflight, dtype=np.float64)
        self.memory_cap = memory_cap
        self.is_chain = graph.is_chain
        self.compute_prefix = _prefix(graph.array("forward") + graph.array("backward"))
        static = graph.array("params") * (1.0 + optimizer_bytes_per_param_byte)
        self.static_memory_prefix = _prefix(static + graph.array("extra_memory"))
        self.activation_prefix = _prefix(graph.array("activation"))
        edges = [edge for edge in graph.edges if edge.bytes > 0] if bandwidth else []
        self.edge_source = np.array([edge.source for edge in edges], dtype=np.int64)
        self.edge_target = np.array([edge.target for edge in edges], dtype=np.int64)
        self.edge_seconds = np.array(
            [edge.bytes / bandwidth for edge in edges] if bandwidth else [], dtype=np.float64
        )
        self._compute_cache: dict[float, np.ndarray] = {}
        self._memory_cache: dict[float, np.ndarray] = {}

    @property
    def has_comm(self) -> bool:
        """True when some edge costs time to cross a cut."""
        return bool(self.edge_seconds.size and self.edge_seconds.max() > 0)

    @property
    def uniform_speed(self) -> bool:
        """True when every stage runs at the same speed."""
        return bool(np.all(self.speeds == self.speeds[0]))

    @property
    def stage_independent_memory(self) -> bool:
        """True when every stage's memory is the same function of its layers."""
        return (
            self.memory_cap is None
            or bool(np.all(self.inflight == self.inflight[0]))
            or self.activation_prefix[-1] == 0
        )

    def stage_compute_prefix(self, stage: int) -> np.ndarray:
        """Prefix of stage ``stage``'s compute seconds; one shared array per speed."""
        speed = float(self.speeds[stage])
        if speed not in self._compute_cache:
            self._compute_cache[speed] = self.compute_prefix / speed
        return self._compute_cache[speed]

    def stage_memory_prefix(self, stage: int) -> np.ndarray:
        """Prefix of stage ``stage``'s memory bytes; one shared array per inflight count."""
        held = float(self.inflight[stage])
        if held not in self._memory_cache:
            self._memory_cache[held] = self.static_memory_prefix + held * self.activation_prefix
        return self._memory_cache[held]

    def cut_seconds(self) -> np.ndarray:
        """For a chain: seconds to move the tensor across each cut 0..n (0 at both ends)."""
        cut = np.zeros(self.num_layers + 1)
        np.add.at(cut, self.edge_target, self.edge_seconds)
        return cut

    def evaluate(self, boundaries: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-stage (compute seconds, comm seconds, memory bytes) of the given boundaries."""
        cuts = np.asarray(boundaries, dtype=np.int64)
        starts, stops = cuts[:-1], cuts[1:]
        compute = (self.compute_prefix[stops] - self.compute_prefix[starts]) / self.speeds
        memory = (self.static_memory_prefix[stops] - self.static_memory_prefix[starts]) + (
            self.inflight * (self.activation_prefix[stops] - self.activation_prefix[starts])
        )
        comm = np.zeros(len(starts))
        if self.edge_seconds.size:
            stage_of_layer = np.repeat(np.arange(len(starts)), stops - starts)
            sender = stage_of_layer[self.edge_source]
            receiver = stage_of_layer[self.edge_target]
            crossing = sender != receiver
            np.add.at(comm, sender[crossing], self.edge_seconds[crossing])
            np.add.at(comm, receiver[crossing], self.edge_seconds[crossing])
        return compute, comm, memory
