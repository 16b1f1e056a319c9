"""Memory per rank: parameters, gradients, optimizer state (ZeRO-1 sharded), and the
activations held at the schedule's peak, with or without recomputation.

The bytes per parameter follow the engine, which keeps fp32 parameters and gradients even
under bf16/fp16 autocast (master weights) and Adam's two fp32 moments: 4 + 4 + 8 = 16 bytes,
the "16Ψ" of Rajbhandari et al. 2020 (ZeRO, section 3.1); ZeRO-1 divides the 8 by dp
(the engine's ShardedOptimizer shards moments and masters; the masters are the parameters).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from pipeline.planner.profile import LayerProfile
from schedules import Kind, Schedule

__all__ = ["PARAM_BYTES", "MemoryBreakdown", "held_peaks", "peak_rank_memory",
           "recompute_workspace", "stage_activation_bytes"]

PARAM_BYTES = 4.0
"""fp32 weights."""
GRAD_BYTES = 4.0
"""fp32 gradients, accumulated over the step's microbatches."""
ADAM_BYTES = 8.0
"""Adam's exp_avg and exp_avg_sq in fp32."""


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes one rank holds at its peak."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.activations

    def to_dict(self) -> dict[str, float]:
        return {"parameters": self.parameters, "gradients": self.gradients,
                "optimizer": self.optimizer, "activations": self.activations,
                "total": self.total}


def stage_activation_bytes(layers: Sequence[LayerProfile], tp: int, batch: int,
                           recompute: bool) -> float:
    """Bytes one microbatch of `batch` samples leaves on a stage between its forward and its
    backward. Recomputation (the engine's activation_checkpoint_interval=1) keeps each
    layer's input only (Korthikanti et al. 2022, section 4.3: 2sbh per layer at 16 bits)."""
    if recompute:
        return batch * sum(layer.input_bytes for layer in layers)
    return batch * sum(layer.held(tp) for layer in layers)


def recompute_workspace(layers: Sequence[LayerProfile], tp: int, batch: int) -> float:
    """While a recomputed layer runs its backward, its full activations are alive again: the
    largest layer's, once per rank."""
    return batch * max((layer.held(tp) for layer in layers), default=0.0)


def held_peaks(schedule: Schedule) -> tuple[int, ...]:
    """Most (stage, microbatch) activations each rank holds at once, read off the rank's own
    op order (so it holds under any costs): held from its F to its last backward op (B, or
    W when the backward is split), as `schedules.figures` counts them."""
    streams = schedule.streams
    lengths = np.array([len(stream) for stream in streams])
    ops = [op for stream in streams for op in stream]
    if not ops:
        return (0,) * len(streams)
    columns = list(zip(*ops))  # kind, stage, microbatch columns, transposed in C
    # enum members are singletons: their ids are the fastest exact codes (no Enum.__hash__)
    kind = np.fromiter(map(id, columns[0]), dtype=np.int64, count=len(ops))
    rank = np.repeat(np.arange(len(streams)), lengths)
    key = (rank * schedule.num_stages + np.asarray(columns[1])) * schedule.num_microbatches \
        + np.asarray(columns[2])
    is_w = kind == id(Kind.W)
    release = (kind == id(Kind.B)) | is_w | ((kind == id(Kind.I)) & ~np.isin(key, key[is_w]))
    held = np.cumsum((kind == id(Kind.F)).astype(np.int64) - release)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    # every rank's running count restarts at 0: subtract what the ranks before it ended on
    before = np.concatenate([[0], held[np.cumsum(lengths)[:-1] - 1]])
    peaks = np.zeros(len(streams), dtype=np.int64)
    busy = lengths > 0
    peaks[busy] = np.maximum.reduceat(held - np.repeat(before, lengths), starts[busy])
    return tuple(int(x) for x in peaks)


def peak_rank_memory(stage_params: ArrayLike, stage_held: ArrayLike,
                     stage_workspace: ArrayLike, placement: Sequence[int],
                     peaks: Sequence[int], *, dp: int, zero: int, recompute: bool
                     ) -> tuple[MemoryBreakdown, int]:
    """Memory of the pipeline rank holding the most, and that rank.

    Per stage: `stage_params` parameters one tp rank holds, `stage_held` bytes one
    microbatch leaves between forward and backward (`stage_activation_bytes`),
    `stage_workspace` the recomputation workspace (`recompute_workspace`). Rank r holds
    the stages `placement` puts on it and `peaks[r]` microbatches at once. With several
    chunks per rank the count is priced at the rank's largest stage: exact for v = 1, an
    upper bound otherwise.
    """
    ranks = len(peaks)
    where = np.asarray(placement)
    params = np.bincount(where, weights=np.asarray(stage_params, dtype=float),
                         minlength=ranks)
    held, workspace = np.zeros(ranks), np.zeros(ranks)
    np.maximum.at(held, where, np.asarray(stage_held, dtype=float))
    np.maximum.at(workspace, where, np.asarray(stage_workspace, dtype=float))
    per_param = PARAM_BYTES + GRAD_BYTES + ADAM_BYTES / (dp if zero >= 1 else 1)
    activations = np.asarray(peaks) * held + (workspace if recompute else 0.0)
    rank = int(np.argmax(params * per_param + activations))
    shard = dp if zero >= 1 else 1
    return MemoryBreakdown(float(params[rank] * PARAM_BYTES), float(params[rank] * GRAD_BYTES),
                           float(params[rank] * ADAM_BYTES / shard),
                           float(activations[rank])), rank
