"""Top-k softmax routing and the per-expert statistics the load-balancing loss is made of."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["RouterStatistics", "Routing", "route", "router_statistics"]


class Routing(NamedTuple):
    """Where n tokens go: k experts each, with their combine weights."""

    probs: torch.Tensor
    """[n, E] fp32 softmax over every expert (the load-balancing loss reads these)."""
    weights: torch.Tensor
    """[n, k] combine weights of the chosen experts (renormalised when the family does)."""
    experts: torch.Tensor
    """[n, k] indices of the chosen experts, best first."""


class RouterStatistics(NamedTuple):
    """One layer's share of the Switch-Transformer load-balancing loss on one microbatch."""

    prob_sums: torch.Tensor
    """[E] router probabilities summed over the (unmasked) tokens; carries gradient."""
    counts: torch.Tensor
    """[E] top-k assignments per expert over the (unmasked) tokens; no gradient."""
    rows: torch.Tensor
    """0-d: the tokens counted (HF's ``total_rows`` for one layer)."""


def route(logits: torch.Tensor, top_k: int, *, normalize: bool,
          bias: torch.Tensor | None = None) -> Routing:
    """Softmax in fp32, the k most probable experts, and (`normalize`, Mixtral always and
    Qwen-MoE with ``norm_topk_prob``) their weights divided by their sum, cast back to the
    logits' dtype as HF's routers do.

    `bias` ([E], DeepSeek-V3's auxiliary-loss-free balancing, `pipeline.moe.expert_bias`)
    is added to the probabilities for choosing the k experts only: the combine weights are
    the chosen experts' unbiased probabilities."""
    probs = F.softmax(logits.float(), dim=-1)
    if bias is None:
        weights, experts = torch.topk(probs, top_k, dim=-1)
    else:
        _, experts = torch.topk(probs + bias.detach().float(), top_k, dim=-1)
        weights = probs.gather(1, experts)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(probs, weights.to(logits.dtype), experts)


def router_statistics(routing: Routing, mask: torch.Tensor | None) -> RouterStatistics:
    """Per-expert probability sums and assignment counts, tokens weighted by `mask` ([n],
    1 for a real token, 0 for padding) as HF's ``load_balancing_loss_func`` weights them."""
    n, num_experts = routing.probs.shape
    weight = (torch.ones(n, device=routing.probs.device) if mask is None
              else mask.reshape(-1).to(routing.probs.device, torch.float32))
    prob_sums = (routing.probs * weight.unsqueeze(-1)).sum(dim=0)
    with torch.no_grad():
        top_k = routing.experts.shape[-1]
        counts = torch.zeros(num_experts, device=weight.device).scatter_add_(
            0, routing.experts.reshape(-1), weight.repeat_interleave(top_k))
    return RouterStatistics(prob_sums, counts, weight.sum())
