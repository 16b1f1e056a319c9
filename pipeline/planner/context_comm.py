"""Megatron-Core's other context-parallel types: Q/K/V/O all-to-all (a2a), K/V all-gather."""

# Read from NVIDIA/Megatron-LM d98e8a64ddf34856e74b24714e3bedb2f5a39553 and
# NVIDIA/TransformerEngine d0067d0da6cb01811b8072a7d304f0e00344ce2b (both 2026-08-22):
# - `megatron/training/arguments.py`: --cp-comm-type "p2p, a2a, allgather or a2a+p2p"
#   (default ["p2p"]: `context_ring`; a2a+p2p, the hierarchical one, is not priced);
#   `megatron/core/extensions/transformer_engine.py` hands it to TE's DotProductAttention.
# - TE `transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py`:
#   * `AttnFuncWithCPAndQKVOA2A` (DeepSpeed-Ulysses): asserts "cp_comm_type='a2a' requires
#     num_heads % cp_size == 0 for Q, K, V" (heads and K/V heads per tp rank). Forward:
#     `flash_attn_a2a_communicate(["q", "k", "v"])`, three `all_to_all_single` over the cp
#     group (each rank's s/cp tokens × heads/t in, all s tokens × heads/(t·cp) out), then the
#     attention on the whole sequence, then one all-to-all of the output back
#     (`["out"]`). Backward: the all-to-all of dO, the attention backward, the all-to-all
#     of dQ, dK, dV. The three all-to-alls are issued async but on one NCCL stream, one after
#     another; only the reordering copy of one runs (on cp_stream) beside the next one's
#     transfer, and the function ends with `wait_stream(cp_stream)` before the attention:
#     nothing overlaps the attention, all eight all-to-alls are exposed.
#   * `AttnFuncWithCPAndKVAllGather` ("KV all-gather between CP ranks is exposed", Llama 3
#     §3.3.2): forward `gather_along_first_dim(k)` and `(v)` (blocking) before the two
#     query-chunk steps; the two steps run on two streams beside each other (compute beside
#     compute, for wave quantization), not beside the gather. Backward: K and V gathered
#     again (the local k and v are saved, not the gathered), the two steps' backward, then
#     `reduce_scatter_along_first_dim(dk)` and `(dv)`. All exposed.
# All-to-alls are priced as expert parallelism's (`expert_parallel.all_to_all_seconds`,
# each member sending its local tensor spread evenly over the group); the gathers as this
# engine's cp gather (`context_parallel.gather_seconds`), the reduce-scatters as
# `pricing.reduce_scatter_seconds` with NCCL's model (else the same ring bytes).

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from pipeline.planner.context_parallel import gather_seconds, recomputed_whole
from pipeline.planner.context_ring import ring_layer_seconds
from pipeline.planner.expert_parallel import all_to_all_seconds
from pipeline.planner.pricing import reduce_scatter_seconds
from pipeline.planner.profile import LayerProfile, ModelProfile

if TYPE_CHECKING:
    from pipeline.planner.cluster import ClusterSpec
    from pipeline.planner.stages import StageCosts, StageTable

__all__ = ["CP_COMM_TYPES", "a2a_layer_seconds", "a2a_refusal", "comm_costs",
           "kv_allgather_layer_seconds", "model_a2a_refusal"]

CP_COMM_TYPES = {"p2p": "ring", "a2a": "a2a", "allgather": "kv-allgather"}
"""Megatron-Core's --cp-comm-type → `SearchOptions.cp_attention`."""


def a2a_refusal(heads: int, kv_heads: int, tp: int, cp: int) -> str:
    """Why a2a cannot run at (tp, cp) ("" if it can): TE splits each tp rank's heads and
    K/V heads over cp (`AttnFuncWithCPAndQKVOA2A`'s assertion)."""
    if cp <= 1:
        return ""
    bad = [f"{what} {count} / tp {tp} = {count // tp}" for what, count in
           (("attention heads", heads), ("key/value heads", kv_heads))
           if count % tp == 0 and (count // tp) % cp]
    return (f"--cp-comm-type a2a splits each tp rank's heads over cp {cp}: "
            f"{', '.join(bad)} not divisible by {cp}") if bad else ""


def model_a2a_refusal(model: ModelProfile, tp: int, cp: int) -> str:
    """`a2a_refusal` for `model`'s heads and K/V heads ("" for a model without heads)."""
    if model.heads is None:
        return ""
    kv_heads = dict(model.tp_divides).get("key/value heads", model.heads)
    return a2a_refusal(model.heads, kv_heads, tp, cp)


def _local_bytes(layer: LayerProfile, tp: int, cp: int) -> tuple[float, float]:
    """(Q or O, K or V) bytes per sample one cp rank holds of one block: s/cp tokens of
    the tp rank's heads; (0, 0) for a layer without attention."""
    shape = layer.shape
    if shape is None or shape.role != "block":
        return 0.0, 0.0
    tokens = shape.seq / cp * shape.element / tp
    return tokens * shape.heads * shape.head_size, tokens * shape.kv_width


def a2a_layer_seconds(layer: LayerProfile, tp: int, cp: int, batch: int,
                      cluster: ClusterSpec) -> tuple[float, float]:
    """(forward, backward) seconds of one block's all-to-alls on one cp rank (module
    comment): Q, K, V and O in the forward, dO, dQ, dK, dV in the backward, all exposed."""
    query, key = _local_bytes(layer, tp, cp)
    if query <= 0:
        return 0.0, 0.0

    def exchange(nbytes: float) -> float:
        return all_to_all_seconds(nbytes * batch, cp, tp, cluster)

    each = 2 * exchange(query) + 2 * exchange(key)  # Q, O and K, V (their gradients alike)
    return each, each


def kv_allgather_layer_seconds(layer: LayerProfile, tp: int, cp: int, batch: int,
                               cluster: ClusterSpec) -> tuple[float, float]:
    """(forward, backward) seconds of one block's K/V collectives on one cp rank (module
    comment): K and V all-gathered in the forward, gathered again and dK, dV
    reduce-scattered in the backward, all exposed."""
    _, key = _local_bytes(layer, tp, cp)
    if key <= 0:
        return 0.0, 0.0
    whole = key * cp * batch  # one of K or V, the whole sequence
    gather = gather_seconds(whole, cp, tp, cluster)
    scatter = reduce_scatter_seconds(whole, cp, tp, cluster) if cluster.nccl_arch \
        else gather_seconds(whole, cp, tp, cluster)
    return 2 * gather, 2 * gather + 2 * scatter


_LAYER_SECONDS = {"a2a": a2a_layer_seconds, "kv-allgather": kv_allgather_layer_seconds}


def _layer_seconds(table: StageTable, layer: LayerProfile, batch: int) -> tuple[float, float]:
    """(forward, backward) seconds one layer's cp collectives expose, by `table.cp_attention`:
    the ring's overlapped steps (`context_ring`) or the exposed a2a / K/V all-gather."""
    if table.cp_attention == "ring":
        return ring_layer_seconds(layer, table, batch)
    return _LAYER_SECONDS[table.cp_attention](layer, table.tp, table.cp, batch, table.cluster)


def _stages_seconds(table: StageTable, batch: int, again: bool) -> np.ndarray:
    """Per stage: (forward, backward) seconds summed over its attention layers (with
    `again`, over the layers whose attention forward runs again: those recomputed whole,
    or every one under selective recomputation, whose checkpoint is Megatron-Core's
    `Attention._checkpointed_attention_forward` around TE's DotProductAttention, the cp
    collectives (the ring's too) inside it: `--recompute-modules` defaults to core_attn)."""
    sums = np.zeros((len(table.stages), 2))
    for index, stage in enumerate(table.stages):
        layers = stage if not again or table.recompute == "selective" else \
            recomputed_whole(stage, table.recompute, table.recompute_layers)
        for layer in layers:
            sums[index] += _layer_seconds(table, layer, batch)
    return sums


def comm_costs(table: StageTable, costs: StageCosts, batch: int) -> StageCosts:
    """`costs` of one of cp ranks (compute already divided by cp) plus what Megatron-Core's
    cp collectives expose (`table.cp_attention`: the ring's excess over its steps' attention,
    or the a2a / K/V all-gather, none overlapped): the forward's in the forward (and again in
    a recomputed forward or attention core), the backward's in the input-gradient backward;
    `cp_comm` says how much of the ops they are."""
    seconds = _stages_seconds(table, batch, again=False)
    again = _stages_seconds(table, batch, again=True)[:, 0]
    forward, backward = seconds[:, 0], seconds[:, 1]
    return replace(costs, forward=costs.forward + forward,
                   input_grad=costs.input_grad + again + backward,
                   recompute=costs.recompute + again, cp_comm=forward + backward + again)
