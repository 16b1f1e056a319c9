"""Per-stage sums of a partition, linear in the microbatch size, so the search prices any
microbatch of any configuration with a few array operations."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.memory import recompute_workspace, stage_activation_bytes
from pipeline.planner.profile import LayerProfile, ring_allreduce_seconds

__all__ = ["StageCosts", "StageTable"]


@dataclass(frozen=True)
class StageCosts:
    """Per-stage seconds of one microbatch: forward, input gradient, weight gradient, and
    the tensor-parallel and recomputation shares inside them; boundary bytes."""

    forward: np.ndarray
    input_grad: np.ndarray
    weight_grad: np.ndarray
    tp_comm: np.ndarray
    recompute: np.ndarray
    boundary_bytes: np.ndarray

    @property
    def total(self) -> np.ndarray:
        return self.forward + self.input_grad + self.weight_grad


@dataclass(frozen=True)
class StageTable:
    """One partition's stages at one tp size, with or without recomputation.

    Every time is linear in the microbatch size b (fixed overheads and latencies plus
    per-sample work and bytes), so it is stored as the value at b = 0 and the slope.
    """

    boundaries: tuple[int, ...]
    params: np.ndarray
    """Parameters one tp rank holds, per stage."""
    held: np.ndarray
    """Activation bytes per sample a microbatch leaves between forward and backward."""
    workspace: np.ndarray
    """Recomputation workspace per sample (the stage's largest layer's activations)."""
    forward: tuple[np.ndarray, np.ndarray]
    backward: tuple[np.ndarray, np.ndarray]
    tp_comm: tuple[np.ndarray, np.ndarray]
    boundary: np.ndarray
    """Bytes per sample of each stage's output."""
    recompute: bool

    @classmethod
    def build(cls, layers: Sequence[LayerProfile], boundaries: Sequence[int],
              cluster: ClusterSpec, precision: str, tp: int, recompute: bool) -> StageTable:
        stages = [layers[a:b] for a, b in pairwise(boundaries)]

        def line(values: list[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
            at_zero = np.array([v[0] for v in values])
            return at_zero, np.array([v[1] for v in values]) - at_zero

        forward: list[tuple[float, float]] = []
        backward: list[tuple[float, float]] = []
        comm: list[tuple[float, float]] = []
        for stage in stages:
            empty = [layer.times(cluster, precision, 0, tp) for layer in stage]
            single = [layer.times(cluster, precision, 1, tp) for layer in stage]
            # the runtime's fixed cost: once per op, F and the two halves of the backward
            fixed = (cluster.op_overhead, 2 * cluster.op_overhead)
            forward.append((fixed[0] + sum(t[0] for t in empty),
                            fixed[0] + sum(t[0] for t in single)))
            backward.append((fixed[1] + sum(t[1] for t in empty),
                             fixed[1] + sum(t[1] for t in single)))
            comm.append((_tp_seconds(stage, cluster, tp, 0), _tp_seconds(stage, cluster, tp, 1)))
        return cls(
            boundaries=tuple(boundaries),
            params=np.array([sum(layer.params(tp) for layer in stage) for stage in stages]),
            held=np.array([stage_activation_bytes(stage, tp, 1, recompute) for stage in stages]),
            workspace=np.array([recompute_workspace(stage, tp, 1) for stage in stages]),
            forward=line(forward), backward=line(backward), tp_comm=line(comm),
            boundary=np.array([stage[-1].output_bytes for stage in stages]),
            recompute=recompute)

    def costs(self, batch: int) -> StageCosts:
        """Seconds of one microbatch of `batch` samples on every stage. The backward splits
        evenly into input and weight gradients (one matmul each, as the Zero Bubble paper
        assumes); recomputation runs the forward again before the input gradient."""
        forward = self.forward[0] + self.forward[1] * batch
        backward = self.backward[0] + self.backward[1] * batch
        recompute = forward if self.recompute else np.zeros_like(forward)
        return StageCosts(forward, backward / 2 + recompute, backward / 2,
                          self.tp_comm[0] + self.tp_comm[1] * batch, recompute,
                          self.boundary * batch)


def _tp_seconds(stage: Sequence[LayerProfile], cluster: ClusterSpec, tp: int, batch: int
                ) -> float:
    """Seconds of the stage's tensor-parallel all-reduces, forward and backward."""
    if tp <= 1:
        return 0.0
    bandwidth, latency = cluster.link(tp)
    return sum(2 * layer.tp_allreduces * ring_allreduce_seconds(
        layer.tp_allreduce_bytes * batch, tp, bandwidth, latency) for layer in stage)
