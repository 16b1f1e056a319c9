"""Looped breadth-first pipeline (Lamy-Poirier 2023): several chunks per rank, one at a time."""

from __future__ import annotations

from schedules.ir.instructions import NONE, Kind, instruction_from
from schedules.ir.schedule import Schedule, check_count, loop_placement

__all__ = ["looped_bfs"]


def looped_bfs(num_ranks: int, num_microbatches: int, chunks: int = 2) -> Schedule:
    """Looped BFS (Lamy-Poirier, "Breadth-First Pipeline Parallelism", MLSys 2023,
    https://arxiv.org/abs/2211.05953).

    Stage c·p + r lives on rank r (loop placement, v = `chunks`). Each rank runs the forward
    of every microbatch through its first chunk, then its second, ... (breadth first), then
    the backwards chunk by chunk in reverse. A rank holds all v·m chunk activations at the
    turn, like GPipe, but every chunk sees its m microbatches back to back, which suits
    data-parallel sharding (one gather and one reduce per chunk per step). Any m, v >= 1;
    with m >= p a chunk's next stage is never waited for.
    """
    # Legend: p ranks, v chunks per rank, S = p·v stages, m microbatches; F forward,
    # B fused backward.
    p = check_count("num_ranks", num_ranks)
    m = check_count("num_microbatches", num_microbatches)
    v = check_count("chunks", chunks)
    streams = []
    for r in range(p):
        stages = [c * p + r for c in range(v)]
        forward = [instruction_from((Kind.F, s, i, NONE)) for s in stages for i in range(m)]
        backward = [instruction_from((Kind.B, s, i, NONE)) for s in reversed(stages)
                    for i in range(m)]
        streams.append(tuple(forward + backward))
    return Schedule("looped-bfs", m, loop_placement(p, v), tuple(streams))
