"""Tied weights across pipeline ranks: the copy a rank holds besides the first stage's, and
the all-reduce that keeps the copies' gradients equal.

Both engines the planner prices keep a full copy of a tied weight (a GPT's embedding, re-used
by the output projection) on every rank holding a layer that uses it, and sum the copies'
gradients once a step, blocking, after the last backward and before the optimizer step:
Megatron-LM (`word_embeddings` on the last stage, all-reduced over the "embedding group" of
the first and last stage: `train_step` in 2021, after the data-parallel all-reduce;
`_allreduce_word_embedding_grads` in Megatron-Core) and this engine (`TiedLayerSpec`, whose
owners' gradients `pipeline.parallel.tied_sync.TiedWeightSynchronizer` all-reduces at STEP).
A copy is priced as any parameter of its stage: weight, gradient and optimizer state (ZeRO-1
shards it over dp too: the engine's own region, `TIED_REGION`), its data-parallel reduction
and its update. This engine (`tied_reduce_at_step`) keeps every tied weight of a rank in its
own ZeRO-1 region (`TIED_REGION`), reduced over dp at STEP after the owners' sum
(`TiedGradReducer.wait`), not with the stage's buckets: exposed (`tied_step_reduction`);
under ZeRO-1 it also holds the weight's gradient twice through the backward (the `.grad`
its owners sum, and the region's flat buffer it joins at STEP: 4 bytes more an element).
Megatron-LM reduces the copy with the stage's other gradients.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.planner import nccl_model
from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.pricing import allreduce_seconds, ring_allreduce_seconds
from pipeline.planner.stages import StageTable

__all__ = ["stage_params", "tied_allreduce_seconds", "tied_copies", "tied_held",
           "tied_step_reduction", "tied_through"]


def tied_copies(table: StageTable, placement: Sequence[int]) -> np.ndarray:
    """Per stage: parameters one tp rank holds as its copy of the first layer's tied weight,
    `table.tied` where the stage's rank (`placement`) is not the first stage's; none at
    p = 1 or where a V-shaped schedule puts the first and the last stage on one rank."""
    where = np.asarray(placement)
    return np.where(where != where[0], table.tied, 0.0)


def tied_held(table: StageTable, placement: Sequence[int]) -> np.ndarray:
    """Per stage: tied parameters one tp rank holds, the first stage the weight itself (as
    large as its largest use, `table.tied`), each stage on another rank its copy
    (`tied_copies`); all zero for an untied model."""
    held = tied_copies(table, placement).astype(float)
    held[0] += float(table.tied.max(initial=0.0))
    return held


def tied_step_reduction(rank_held: np.ndarray, cluster: ClusterSpec, *, dp: int, tp: int,
                        zero_stage: int, element_bytes: float) -> np.ndarray:
    """Per rank: seconds of this engine's data-parallel reduction of the `rank_held` tied
    parameters at STEP (an all-reduce; ZeRO-1's reduce-scatter, half its traffic)."""
    return np.array([allreduce_seconds(float(x) * element_bytes, dp, tp, cluster)
                     / (2 if zero_stage else 1) if x > 0 else 0.0 for x in rank_held])


def stage_params(table: StageTable, placement: Sequence[int]) -> np.ndarray:
    """Parameters one tp rank holds per stage: its own and its copy (`tied_copies`)."""
    return table.params + tied_copies(table, placement)


def tied_allreduce_seconds(table: StageTable, placement: Sequence[int], cluster: ClusterSpec,
                           *, dp: int, tp: int, element_bytes: float) -> np.ndarray:
    """Per pipeline rank: seconds of the tied gradients' all-reduce on the first stage's rank
    and on every rank holding a copy (`tied_copies`); 0 elsewhere, and everywhere without one.

    Legend: g ranks in the group (2 for a tied embedding), k their pipeline ranks, d and t
    the dp and tp sizes. A ring all-reduce of the copy's gradient (the weight's V·h/t
    elements, `element_bytes` each) over the g ranks; the d·t groups run side by side, each
    over its own link. Pipeline rank k sits k·d·t ranks into the rank order (pipeline
    outermost, as `p2p.blocking_p2p` takes it), so the group spans
    (k_max - k_min)·d·t + 1 ranks, on one node when those fit in one."""
    where = np.asarray(placement)
    ranks = int(where.max()) + 1
    held = np.bincount(where, weights=tied_copies(table, placement), minlength=ranks)
    seconds = np.zeros(ranks)
    if not held.any():
        return seconds
    group = sorted({int(where[0]), *np.flatnonzero(held).tolist()})
    span = (group[-1] - group[0]) * dp * tp + 1
    nbytes = float(held.max()) * element_bytes
    if cluster.nccl_arch:  # NCCL's pick, the g ranks on one node or each on its own
        local = len(group) if span <= cluster.devices_per_node else 1
        seconds[group] = nccl_model.choose("allreduce", nbytes, len(group), local,
                                           cluster).seconds
    else:
        seconds[group] = ring_allreduce_seconds(nbytes, len(group), *cluster.link(span))
    return seconds


def tied_through(ready: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Per rank: when it is through the tied all-reduce, given when it is `ready` (its
    pipeline drained and its data-parallel reduction done) and the all-reduce's `seconds`
    (`tied_allreduce_seconds`). A blocking collective: its ranks start it together, when the
    last of them is ready; the others are through when they are ready."""
    through = ready.copy()
    group = seconds > 0
    if group.any():
        through[group] = ready[group].max() + seconds[group]
    return through
