"""Emulated tensor-parallel devices: the overlapped layers' GEMMs and collectives as timed waits.

`EmulatedTensorParallelOps` is a `pipeline.parallel.tensor.overlap.TensorParallelOps`: each
GEMM computes its (small) result, then waits its nominal time on the device queue
(`emulated.WallClock`); each collective is a timed wait on the link, which runs one
collective at a time and starts one when both the device has issued it and the link is
free; its handle's `wait` returns at the collective's nominal end. The collective's result
is a stand-in of the right shape made from this rank's tensor alone (no bytes move: on a
loaded host a real gloo collective takes longer than the nominal times being emulated,
and the tp ranks are symmetric, so each rank's timing is the group's). So a rank behaves
like an accelerator with a copy engine: collectives overlap the GEMMs issued after them,
never each other, and ranks > cores still overlap for real. The numbers are not the
group's sums: use it to time, never to train.

Costs (`EmulatedTensorParallelCosts`): a GEMM m×n×k costs 2mnk FLOPs at `flop_seconds` each;
a collective the ring's bytes per link (all-gather (t-1)·n, reduce-scatter (t-1)/t·n,
all-reduce 2(t-1)/t·n for an input of n bytes) at `byte_seconds` each, plus `latency`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch.distributed import ProcessGroup

from pipeline.parallel.tensor.collectives import tp_rank_and_size
from pipeline.parallel.tensor.overlap import Collective, Gemm, Pending
from pipeline.rehearsal.emulated import WALL_CLOCK, Clock, check_nonnegative_seconds
from schedules.analysis.tp_overlap import ParallelLinearCosts, linears_exposed

__all__ = ["EmulatedTensorParallelCosts", "EmulatedTensorParallelOps", "LinearShape",
           "predict_blocks_exposed"]

BYTES = 4  # float32


@dataclass(frozen=True, kw_only=True)
class EmulatedTensorParallelCosts:
    """Nominal seconds of the emulated GEMMs and collectives."""

    flop_seconds: float
    """Seconds per FLOP of a GEMM."""
    byte_seconds: float
    """Seconds per byte through a rank's link."""
    latency: float = 0.0
    """Seconds every collective pays once."""

    def __post_init__(self) -> None:
        check_nonnegative_seconds(self, ("flop_seconds", "byte_seconds", "latency"))

    def gemm(self, m: int, n: int, k: int) -> float:
        """Seconds of an (m × k)·(k × n) GEMM."""
        return 2.0 * m * n * k * self.flop_seconds

    def collective(self, collective: Collective, nbytes: float, tp: int) -> float:
        """Seconds of `collective` over `tp` ranks of an input of `nbytes` bytes."""
        if tp <= 1:
            return 0.0
        wire = {Collective.ALL_GATHER: tp - 1.0, Collective.REDUCE_SCATTER: (tp - 1.0) / tp,
                Collective.ALL_REDUCE: 2.0 * (tp - 1.0) / tp}[collective]
        return self.latency + wire * nbytes * self.byte_seconds


def _stand_in(collective: Collective, tensor: torch.Tensor, tp: int, dim: int
              ) -> torch.Tensor:
    """A result of the collective's shape from this rank's tensor alone."""
    if collective is Collective.ALL_GATHER:
        return torch.cat([tensor] * tp, dim=dim)
    if collective is Collective.REDUCE_SCATTER:
        return tensor.narrow(dim, 0, tensor.shape[dim] // tp).clone()
    return tensor.clone()


class _Timed:
    """A collective's result, handed out no earlier than its nominal end on the link."""

    def __init__(self, result: torch.Tensor, deadline: float, clock: Clock) -> None:
        self._result, self._deadline, self._clock = result, deadline, clock

    def wait(self) -> torch.Tensor:
        self._clock.sleep_until(max(self._deadline, self._clock.now()), "tp-wait")
        return self._result


class EmulatedTensorParallelOps:
    """GEMMs and collectives that cost `costs`' nominal times (see the module docstring)."""

    def __init__(self, costs: EmulatedTensorParallelCosts, clock: Clock = WALL_CLOCK) -> None:
        self.costs, self.clock = costs, clock
        self._link_free = -math.inf

    def matmul(self, a: torch.Tensor, b: torch.Tensor, gemm: Gemm) -> torch.Tensor:
        start = self.clock.now()
        out = torch.matmul(a, b)
        rows = math.prod(a.shape[:-1])
        self.clock.sleep_until(start + self.costs.gemm(rows, b.shape[-1], a.shape[-1]),
                               gemm.value)
        return out

    def start(self, collective: Collective, tensor: torch.Tensor, group: ProcessGroup | None,
              dim: int) -> Pending:
        issued = self.clock.now()
        tp = tp_rank_and_size(group)[1]
        seconds = self.costs.collective(collective, tensor.numel() * tensor.element_size(), tp)
        self._link_free = max(issued, self._link_free) + seconds
        return _Timed(_stand_in(collective, tensor, tp, dim), self._link_free, self.clock)


LinearShape = tuple[Literal["column", "row"], int, int]
"""A block's tensor-parallel linear: its kind, input and output features on one tp rank."""


def predict_blocks_exposed(costs: EmulatedTensorParallelCosts, *, tp: int, batch: int,
                           seq: int, hidden: int, ffn: int, blocks: int,
                           sequence_parallel: bool, overlap: bool, chunks: int,
                           linear_shapes: list[LinearShape] | None = None,
                           slice_reductions: int = 6) -> float:
    """The rule's (`schedules.analysis.tp_overlap`) exposed seconds of `blocks`
    `ParallelTransformerBlock`s (with biases), one forward + backward, at the nominal GEMM and
    collective costs these ops wait; under sequence parallelism plus the `slice_reductions`
    all-reduces through these ops of the gradients of parameters used on sequence slices
    (norms' weight and bias, the row layers' biases: exposed). `linear_shapes` (default: that
    block's qkv, proj, fc1, fc2) describes another block, e.g. a HF one's fused q;k;v, o_proj,
    fused gate;up and down_proj."""
    tokens = batch * seq
    local = tokens // tp if sequence_parallel else tokens
    if sequence_parallel:  # all-gather of the slice / reduce-scatter of the whole: same wire
        whole = costs.collective(Collective.ALL_GATHER, local * hidden * BYTES, tp)
        chunk = costs.collective(Collective.ALL_GATHER, local * hidden * BYTES / chunks, tp)
    else:
        whole = costs.collective(Collective.ALL_REDUCE, tokens * hidden * BYTES, tp)
        chunk = costs.collective(Collective.ALL_REDUCE, tokens * hidden * BYTES / chunks, tp)
    shapes: list[LinearShape] = linear_shapes or [
        ("column", hidden, 3 * hidden // tp), ("row", hidden // tp, hidden),
        ("column", hidden, ffn // tp), ("row", ffn // tp, hidden)]
    linears = []
    for kind, inputs, outputs in shapes:
        gemm = costs.gemm(tokens, outputs, inputs)  # forward, dX and dW: the same FLOPs
        linears.append(ParallelLinearCosts(kind, gemm, gemm, gemm, whole, chunk))
    forward, backward = linears_exposed(linears, sequence_parallel=sequence_parallel,
                                        overlap=overlap, chunks=chunks)
    if sequence_parallel:  # the norms' weight and bias and the row biases: 6 all-reduces
        backward += slice_reductions * costs.collective(Collective.ALL_REDUCE, hidden * BYTES, tp)
    return blocks * (forward + backward)
