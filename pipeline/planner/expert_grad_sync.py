"""How an engine sums and reduces the MoE layers' gradients at tp > 1 with expert tensor
parallelism 1 (`SearchOptions.expert_grad_group`): Megatron-Core's rule or this engine's.

Legend: t tensor-parallel ranks, d the data-parallel (× context-parallel) ranks of a
stage, ep the ranks splitting the experts, m microbatches a step. Every tp rank of an ep
rank holds the same experts, router and shared experts whole and routes 1/t of the tokens
(`pipeline.interop.hf_moe_tp`), so each holds a part of their gradients to be summed:

- "megatron" (Megatron-Core): summed with the data-parallel reduction, once a step, over
  its expert-data-parallel group of the t·d / ep ranks holding the same experts
  (`expert_parallel.expert_group`); ZeRO shards the experts' states over those ranks.
- "tp_rank" (this engine): under ZeRO-0 / 1 the step's accumulated MoE gradients of a
  stage are summed over tp once, one coalesced synchronous all-reduce before the stage's
  data-parallel reduction (two with `overlap_grad_reduce`: the dense parameters' and the
  experts', `pipeline.parallel.partial_grad_reducer`), exposed
  (`tp_gradient_step_seconds`); under ZeRO-2 / 3 a tensor hook per MoE parameter still
  sums its gradient over tp each time autograd computes it
  (`sum_gradient_over_tensor_parallel`: one all-reduce of the whole gradient, waited)
  inside every microbatch's backward (B, or W when split: `tp_gradient_sum_seconds`). The
  step then reduces the experts over the d / ep ranks with the same tp rank
  (`Topology.expert_dp_group`), over which ZeRO shards their states: t times more of them
  per rank than Megatron-Core's.

The norms (and biases) that sequence parallelism leaves partial are summed the same way
but not priced here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.errors import PlanError
from pipeline.planner.expert_parallel import expert_group
from pipeline.planner.pricing import allreduce_seconds
from pipeline.planner.profile import LayerProfile

__all__ = ["EXPERT_GRAD_GROUPS", "check_expert_grad_group", "engine_expert_group",
           "expert_replicas", "moe_gradient_parts", "moe_gradient_tensors",
           "tp_gradient_step_seconds",
           "tp_gradient_sum_seconds"]

EXPERT_GRAD_GROUPS = ("tp_rank", "megatron")
"""The rules (module docstring): this engine's, Megatron-Core's."""


def check_expert_grad_group(rule: object) -> str:
    """`rule` if it is one of `EXPERT_GRAD_GROUPS`, else a one-line `PlanError`."""
    if rule not in EXPERT_GRAD_GROUPS:
        raise PlanError(f"expert_grad_group={rule!r} is not known; choose from "
                        f"{', '.join(EXPERT_GRAD_GROUPS)} (this engine's tp-rank groups, "
                        "Megatron-Core's t·dp / ep)")
    return str(rule)


def engine_expert_group(dp: int, tp: int, ep: int, rule: str) -> tuple[int, int]:
    """(ranks, stride) of the group over which `rule` reduces the experts' gradients once a
    step and ZeRO shards their states. `dp`: the stage's data-parallel ranks (× cp).
    "tp_rank": the d / ep ranks with this rank's tp and ep ranks, t·ep apart in the rank
    order (tp innermost, then the replicas: `Topology.rank_of`); "megatron": t·d / ep
    (`expert_parallel.expert_group`)."""
    if check_expert_grad_group(rule) == "megatron":
        return expert_group(dp, tp, ep)
    return dp // ep, tp * ep


def expert_replicas(tp: int, rule: str) -> int:
    """The tp ranks of a replica over which, with its d / ep replicas, ZeRO shards the
    experts' states (`memory.rank_states`): t for "megatron", 1 for "tp_rank"."""
    return tp if check_expert_grad_group(rule) == "megatron" else 1


def moe_gradient_tensors(layer: LayerProfile, ep: int, *, split_experts: bool = False
                         ) -> tuple[float, ...]:
    """Parameter counts of the tensors whose gradients a tp rank's hooks sum, one all-reduce
    each, in one MoE block's backward (none for a dense layer): the router (h·E), the rank's
    E / ep experts as the engine stacks them (`pipeline.moe.experts`: SwiGLU's gate and up
    in one tensor E/ep · 2f · h and down E/ep · h · f; otherwise up and down, E/ep · f · h
    each), and a shared expert's matrices (h · f_s each). A shared expert's sigmoid gate
    (h) is not counted. A layer without a kernel shape: its experts' 1/ep as one tensor.
    `split_experts`: the experts split over tp (expert tensor parallelism), whose shards keep
    their own gradients (`pipeline.interop.hf_moe_tp`): the router and shared expert only."""
    if not layer.expert_params:
        return ()
    local = layer.expert_params / ep
    shape = layer.shape
    if shape is None or shape.routed is None:
        return (local,)
    hidden, routed = shape.hidden, shape.routed
    stacked = (2 * local / 3, local / 3) if shape.gated else (local / 2, local / 2)
    shared = (float(hidden * routed.shared_ffn),) * (3 if shape.gated else 2) \
        if routed.shared_ffn else ()
    return (float(hidden * routed.experts), *(() if split_experts else stacked), *shared)


def tp_gradient_sum_seconds(stages: Sequence[Sequence[LayerProfile]], cluster: ClusterSpec,
                            *, tp: int, ep: int, gradient_bytes: float,
                            split_experts: bool = False) -> np.ndarray:
    """Per stage, seconds one microbatch's backward spends in the "tp_rank" rule's hooks
    (ZeRO-2 / 3): one exposed all-reduce over the t neighbouring ranks
    (`pricing.allreduce_seconds`) of each `moe_gradient_tensors` gradient, `gradient_bytes`
    an element (the engine's fp32 gradients, 4), of every MoE block of the stage
    (`split_experts`: as `moe_gradient_tensors`). Zeros at t = 1."""
    if tp <= 1:
        return np.zeros(len(stages))
    return np.array([sum(allreduce_seconds(count * gradient_bytes, tp, 1, cluster)
                         for layer in stage
                         for count in moe_gradient_tensors(layer, ep,
                                                           split_experts=split_experts))
                     for stage in stages], dtype=float)


def moe_gradient_parts(layer: LayerProfile, ep: int, *, split_experts: bool = False
                       ) -> tuple[float, float]:
    """`moe_gradient_tensors` of one block in two: (the router and shared expert, dense
    parameters; the rank's routed experts, expert shards), as the engine's reducer holds
    them apart (`pipeline.parallel.expert_reduction`)."""
    tensors = moe_gradient_tensors(layer, ep, split_experts=split_experts)
    if not tensors:
        return 0.0, 0.0
    if layer.shape is None or layer.shape.routed is None:
        return 0.0, float(tensors[0])
    experts = 0.0 if split_experts else float(sum(tensors[1:3]))
    return float(sum(tensors)) - experts, experts


def tp_gradient_step_seconds(stages: Sequence[Sequence[LayerProfile]], cluster: ClusterSpec,
                             *, tp: int, ep: int, gradient_bytes: float,
                             split_experts: bool = False, overlap: bool = False
                             ) -> np.ndarray:
    """Per stage, seconds a step spends in the "tp_rank" rule's sum under ZeRO-0 / 1: the
    stage's `moe_gradient_tensors` gradients, `gradient_bytes` an element, all-reduced over
    the t neighbouring ranks once a step before the stage's data-parallel reduction, exposed
    (`pipeline.parallel.partial_grad_reducer`): one coalesced all-reduce, or with `overlap`
    (`overlap_grad_reduce`) two, the dense parameters' (router, shared expert) before their
    bucket and the routed experts' before theirs (`moe_gradient_parts`; more where a stage's
    buckets split them further: not priced). Zeros at t = 1 and for a stage without MoE
    blocks."""
    seconds = []
    for stage in stages:
        parts = [moe_gradient_parts(layer, ep, split_experts=split_experts) for layer in stage]
        dense, experts = sum(part[0] for part in parts), sum(part[1] for part in parts)
        calls = [dense, experts] if overlap else [dense + experts]
        seconds.append(sum(allreduce_seconds(count * gradient_bytes, tp, 1, cluster)
                           for count in calls if tp > 1 and count))
    return np.array(seconds, dtype=float)
