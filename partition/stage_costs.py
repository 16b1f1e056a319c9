"""Stage time and memory of any boundaries: the arrays every method and solver shares."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from partition.errors import InvalidCostError
from partition.graph import ModelGraph
from partition.methods import ScheduleMemory
from partition.prefix_sums import LinearPrefix

__all__ = ["StageCosts", "inflight_microbatches"]

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


class StageCosts:
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
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is refused below
            self._build(graph, speeds, inflight, optimizer_bytes_per_param_byte, bandwidth,
                        memory_cap)
        self._check_totals()

    def _build(
        self,
        graph: ModelGraph,
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
        self.layer_compute = graph.array("forward") + graph.array("backward")
        static = graph.array("params") * (1.0 + optimizer_bytes_per_param_byte)
        self.layer_static_memory = static + graph.array("extra_memory")
        self.layer_activation = graph.array("activation")
        self.compute_prefix = _prefix(self.layer_compute)
        self.static_memory_prefix = _prefix(self.layer_static_memory)
        self.activation_prefix = _prefix(self.layer_activation)
        source, target, sizes = graph.edge_arrays
        paid = sizes > 0 if bandwidth else np.zeros(len(sizes), dtype=bool)
        self.edge_source = source[paid]
        self.edge_target = target[paid]
        self.edge_seconds = sizes[paid] / bandwidth if bandwidth else np.zeros(0)
        # Stage k's compute prefix is P / speed_k, its memory prefix S + inflight_k * A.
        self.compute = LinearPrefix((self.compute_prefix,), (1.0 / self.speeds)[:, None])
        self.memory = LinearPrefix(
            (self.static_memory_prefix, self.activation_prefix),
            np.stack([np.ones(self.num_stages), self.inflight], axis=1),
        )

    def _check_totals(self) -> None:
        """Refuse costs whose sums overflow a float: every value may be finite (1e308 each)
        while the whole model's time or memory is not, and the solvers need finite sums."""
        with np.errstate(over="ignore", invalid="ignore"):
            totals = {
                "compute time (forward + backward, over the slowest speed)":
                    self.compute_prefix[-1] / self.speeds.min(),
                "memory (parameters with optimizer state, extra memory and activations in "
                "flight)": self.static_memory_prefix[-1]
                + self.inflight.max() * self.activation_prefix[-1],
                "communication time (edge bytes over bandwidth)": self.edge_seconds.sum(),
            }
        problems = [f"the layers' {what} add up to {float(total)!r}, past the largest float; "
                    "express the costs in larger units (ms, MB)"
                    for what, total in totals.items() if not math.isfinite(total)]
        if problems:
            raise InvalidCostError(problems)

    @property
    def has_comm(self) -> bool:
        """True when some edge costs time to cross a cut."""
        return bool(self.edge_seconds.size and self.edge_seconds.max() > 0)

    @property
    def uniform_speed(self) -> bool:
        """True when every stage runs at the same speed."""
        return self.compute.stage_independent()

    @property
    def memory_is_stage_independent(self) -> bool:
        """True when every stage's memory is the same function of its layers."""
        return self.memory.stage_independent() or self.activation_prefix[-1] == 0

    def cut_seconds(self) -> np.ndarray:
        """For a chain: seconds to move the tensor across each cut 0..n (0 at both ends)."""
        cut = np.zeros(self.num_layers + 1)
        np.add.at(cut, self.edge_target, self.edge_seconds)
        return cut

    def evaluate(self, boundaries: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-stage (compute seconds, comm seconds, memory bytes) of the given boundaries.

        Sums run over each stage's own layers, not prefix differences, so a small stage
        after huge ones is reported without cancellation."""
        cuts = np.asarray(boundaries, dtype=np.int64)
        starts, stops = cuts[:-1], cuts[1:]
        compute = np.add.reduceat(self.layer_compute, starts) / self.speeds
        memory = np.add.reduceat(self.layer_static_memory, starts) + self.inflight * (
            np.add.reduceat(self.layer_activation, starts)
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
