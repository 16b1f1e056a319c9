"""Per-stage sums of a partition, linear in the microbatch size, so the search prices any
microbatch of any configuration with a few array operations."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.memory import recompute_workspace, stage_activation_bytes
from pipeline.planner.profile import LayerProfile

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
    split: tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]
    """A split backward's input-gradient (I) and weight-gradient (W) lines."""
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
        input_grad: list[tuple[float, float]] = []
        weight_grad: list[tuple[float, float]] = []
        comm: list[tuple[float, float]] = []
        overhead = cluster.op_overhead  # the runtime's fixed cost, once per F, B, I or W
        for stage in stages:
            whole = [[layer.times(cluster, precision, b, tp) for layer in stage] for b in (0, 1)]
            split = [[layer.split_times(cluster, precision, b, tp) for layer in stage]
                     for b in (0, 1)]
            forward.append(_pair(overhead, whole, 0))
            backward.append(_pair(overhead, whole, 1))
            input_grad.append(_pair(overhead, split, 0))
            weight_grad.append(_pair(overhead, split, 1))
            comm.append((2 * sum(layer.tp_seconds(cluster, 0, tp) for layer in stage),
                         2 * sum(layer.tp_seconds(cluster, 1, tp) for layer in stage)))
        return cls(
            boundaries=tuple(boundaries),
            params=np.array([sum(layer.params(tp) for layer in stage) for stage in stages]),
            held=np.array([stage_activation_bytes(stage, tp, 1, recompute) for stage in stages]),
            workspace=np.array([recompute_workspace(stage, tp, 1) for stage in stages]),
            forward=line(forward), backward=line(backward),
            split=(line(input_grad), line(weight_grad)), tp_comm=line(comm),
            boundary=np.array([stage[-1].output_bytes for stage in stages]),
            recompute=recompute)

    def costs(self, batch: int, split: bool = False) -> StageCosts:
        """Seconds of one microbatch of `batch` samples on every stage. A fused backward is
        given as two halves (the simulator adds them for B); a `split` one as its own I and
        W (profiled layers measure them: the runtime's W may cost more than half a
        backward). Recomputation runs the forward again before the input gradient."""
        forward = self.forward[0] + self.forward[1] * batch
        if split:
            (i0, i1), (w0, w1) = self.split
            input_grad, weight_grad = i0 + i1 * batch, w0 + w1 * batch
        else:
            backward = self.backward[0] + self.backward[1] * batch
            input_grad, weight_grad = backward / 2, backward / 2
        recompute = forward if self.recompute else np.zeros_like(forward)
        return StageCosts(forward, input_grad + recompute, weight_grad,
                          self.tp_comm[0] + self.tp_comm[1] * batch, recompute,
                          self.boundary * batch)



def _pair(overhead: float, times: list[list[tuple[float, float]]], index: int
          ) -> tuple[float, float]:
    """(value at b = 0, value at b = 1) of the stage's sum of `times[b][layer][index]`."""
    return (overhead + sum(t[index] for t in times[0]),
            overhead + sum(t[index] for t in times[1]))
