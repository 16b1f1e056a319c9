"""DeepSeek-V3's auxiliary-loss-free balancing: the per-expert bias and its update per step.

Each aux-free MoE layer keeps two [E] fp32 buffers: ``expert_bias`` b (persistent: the
engine's checkpoint saves and restores it with the layer's weights; DeepSeek-V3's router holds
its own, ``gate.e_score_correction_bias``, which HF's checkpoint carries) and ``expert_load``
(not persistent), the top-k assignments its training forwards made this step. b is added to
the routing scores for the top-k choice only (`pipeline.moe.routing.route`), never to the
combine weights. After each optimizer step (DeepSeek-AI, "DeepSeek-V3 Technical Report",
2024, §2.1.2; Megatron-Core ``get_updated_expert_bias``), with c_e the step's load of expert
e summed over every microbatch and every data-parallel replica (the expert-parallel ranks are
replicas too) and c̄ their mean over the E experts:

    b_e <- b_e + u · sign(c̄ - c_e)        (u: ``bias_update_rate``)

so an overloaded expert is chosen less next step and an underloaded one more. The loads
are summed in one all-reduce over the stage's data-parallel group (every layer of the
stage in one tensor; a second over tp, whose ranks each route 1/t of the tokens), so every
replica computes the same bias. A layer recomputed in the
backward (activation checkpointing) leaves its load as the forward left it
(`pipeline.recompute_region.ForwardOnce` restores buffers), so each token counts once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from pipeline.moe.layer import MoEFeedForward

__all__ = ["aux_free_layers", "update_expert_biases", "updated_expert_bias"]


def updated_expert_bias(bias: torch.Tensor, loads: torch.Tensor, rate: float) -> torch.Tensor:
    """b + u · sign(mean(c) - c) over the last dimension (experts)."""
    return bias + rate * torch.sign(loads.mean(dim=-1, keepdim=True) - loads)


def aux_free_layers(module: nn.Module) -> list[MoEFeedForward]:
    """The MoE layers of `module` that balance by expert bias, in module order (the same
    order on every replica of a stage)."""
    return [m for m in module.modules()
            if isinstance(m, MoEFeedForward) and m.balancing.method == "aux-free"]


def update_expert_biases(layers: list[MoEFeedForward], group: ProcessGroup | None,
                         tp_group: ProcessGroup | None = None) -> None:
    """After an optimizer step: sum each layer's load over `group` (the data-parallel group;
    None: this rank is the only replica) and `tp_group` (tensor parallelism: each tp rank
    routes 1/t of the tokens, `pipeline.interop.hf_moe_tp`), move its bias, and start the
    next step's count."""
    if not layers:
        return
    with torch.no_grad():
        loads = torch.stack([layer.load for layer in layers])  # [layers, E]
        for over in (group, tp_group):
            if over is not None and dist.get_world_size(over) > 1:
                dist.all_reduce(loads, group=over)
        for layer, load in zip(layers, loads, strict=True):
            layer.bias.copy_(updated_expert_bias(layer.bias, load,
                                                 layer.balancing.bias_update_rate))
            layer.load.zero_()
