"""Exposed tensor-parallel communication of a layer's linears, with and without overlap: the rule
the engine's overlapped layers follow (`pipeline.parallel.tensor.overlap`), for the planner and
the benchmarks to price them by.

Pure (numbers in, numbers out). A collective runs on the link while the device computes; the
link runs one collective at a time. Two ways the engine overlaps (Megatron-Core's
``--tp-comm-overlap``; Wang et al. 2022, "Overlap communication with dependent computation"):

- beside: a collective of q seconds launched, then independent work of g seconds, then a
  wait: max(0, q - g) exposed (a column layer's input-gradient reduction beside its weight-
  gradient GEMM; under sequence parallelism its input's re-gather beside the input-gradient
  GEMM);
- pipelined: a collective split into c chunks of q seconds each, chunk k's GEMM (G/c) before
  (row: reduce after) or after (column: gather before) chunk k's collective. Either order the
  makespan is c·max(q, G/c) + min(q, G/c), so q + (c-1)·max(0, q - G/c) is exposed.

Without overlap every collective is exposed whole (one chunk).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from schedules.ir.errors import ScheduleConfigError

__all__ = ["ParallelLinearCosts", "beside_exposed", "linear_exposed", "linears_exposed",
           "pipelined_exposed"]


def _check(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or value < 0:
        raise ScheduleConfigError(f"{name} must be a finite number >= 0, got {value!r}")


def beside_exposed(collective: float, compute: float) -> float:
    """Seconds of a `collective` not hidden by `compute` launched after it."""
    _check("collective", collective)
    _check("compute", compute)
    return max(0.0, collective - compute)


def pipelined_exposed(compute: float, chunk_collective: float, chunks: int) -> float:
    """Exposed seconds of `chunks` collectives of `chunk_collective` seconds each, pipelined
    against `compute` seconds of GEMMs split in as many equal parts."""
    _check("compute", compute)
    _check("chunk_collective", chunk_collective)
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ScheduleConfigError(f"chunks must be an int >= 1, got {chunks!r}")
    return chunk_collective + (chunks - 1) * max(0.0, chunk_collective - compute / chunks)


@dataclass(frozen=True)
class ParallelLinearCosts:
    """One tensor-parallel linear layer's seconds for one microbatch on one tp rank."""

    kind: Literal["column", "row"]
    forward: float
    """The forward GEMM."""
    input_grad: float
    """The input-gradient GEMM (dX = dY·W)."""
    weight_grad: float
    """The weight-gradient GEMM (dW = dYᵀ·X)."""
    collective: float
    """The layer's collective, whole: its all-reduce, or under sequence parallelism one
    all-gather or reduce-scatter (each half an all-reduce's bytes)."""
    chunk_collective: float
    """One of the `chunks` slices the overlapped forward sends (the pipelined ones)."""

    def __post_init__(self) -> None:
        if self.kind not in ("column", "row"):
            raise ScheduleConfigError(f"kind must be 'column' or 'row', got {self.kind!r}")
        for name in ("forward", "input_grad", "weight_grad", "collective", "chunk_collective"):
            _check(name, getattr(self, name))


def linear_exposed(linear: ParallelLinearCosts, *, sequence_parallel: bool, overlap: bool,
                   chunks: int = 2) -> tuple[float, float]:
    """(forward, backward) exposed collective seconds of `linear` as the engine runs it.

    column: forward gathers its input under sequence parallelism (pipelined); backward
    re-gathers it beside dX's GEMM (sequence parallelism), then reduces dX (all-reduce, or
    reduce-scatter) beside dW's GEMM. row: forward reduces its output (pipelined); backward
    gathers dY under sequence parallelism (pipelined against dX's GEMM)."""
    q, q_chunk = linear.collective, linear.chunk_collective
    c = chunks if overlap else 1
    chunk = q_chunk if overlap else q
    if linear.kind == "column":
        forward = pipelined_exposed(linear.forward, chunk, c) if sequence_parallel else 0.0
        if not overlap:
            return forward, (2 * q if sequence_parallel else q)
        backward = beside_exposed(q, linear.weight_grad)
        if sequence_parallel:
            backward += beside_exposed(q, linear.input_grad)
        return forward, backward
    forward = pipelined_exposed(linear.forward, chunk, c)
    backward = pipelined_exposed(linear.input_grad, chunk, c) if sequence_parallel else 0.0
    return forward, backward


def linears_exposed(linears: list[ParallelLinearCosts], *, sequence_parallel: bool,
                    overlap: bool, chunks: int = 2) -> tuple[float, float]:
    """(forward, backward) exposed seconds of a layer's linears run one after another."""
    passes = [linear_exposed(linear, sequence_parallel=sequence_parallel, overlap=overlap,
                             chunks=chunks) for linear in linears]
    return sum(f for f, _ in passes), sum(b for _, b in passes)
