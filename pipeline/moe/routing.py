"""Top-k routing (softmax, or DeepSeek-V3's group-limited sigmoid) and the per-expert statistics
the load-balancing loss is made of."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["RouterStatistics", "Routing", "route", "route_grouped", "router_statistics"]


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
          bias: torch.Tensor | None = None, groups: int = 1, top_groups: int = 1,
          scaling: float = 1.0) -> Routing:
    """Softmax in fp32, the k most probable experts, and (`normalize`, Mixtral always and
    Qwen-MoE with ``norm_topk_prob``) their weights divided by their sum, cast back to the
    logits' dtype as HF's routers do.

    `bias` ([E], DeepSeek-V3's auxiliary-loss-free balancing, `pipeline.moe.expert_bias`)
    is added to the probabilities for choosing the k experts only: the combine weights are
    the chosen experts' unbiased probabilities.

    DeepSeek-V2 (HF's ``DeepseekV2TopkRouter``): `groups` > 1 is its
    ``group_limited_greedy``: the E experts in G = `groups` groups of E / G, each group scored
    by its best expert, only the `top_groups` best groups' experts eligible (the others'
    scores set to 0, as HF does); the combine weights are multiplied by `scaling`
    (``routed_scaling_factor``)."""
    probs = F.softmax(logits.float(), dim=-1)
    choice = probs if bias is None else probs + bias.detach().float()
    if groups > 1:
        n, num_experts = choice.shape
        per_group = choice.view(n, groups, num_experts // groups)
        best_groups = torch.topk(per_group.amax(dim=-1), top_groups, dim=-1)[1]
        eligible = torch.zeros(n, groups, dtype=torch.bool, device=choice.device)
        eligible.scatter_(1, best_groups, True)
        choice = choice.masked_fill(
            ~eligible.unsqueeze(-1).expand_as(per_group).reshape(n, num_experts), 0.0)
    if bias is None and groups == 1:
        weights, experts = torch.topk(probs, top_k, dim=-1)
    else:
        experts = torch.topk(choice, top_k, dim=-1)[1]
        weights = probs.gather(1, experts)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scaling != 1.0:
        weights = weights * scaling
    return Routing(probs, weights.to(logits.dtype), experts)


def route_grouped(logits: torch.Tensor, top_k: int, *, groups: int, top_groups: int,
                  normalize: bool, scaling: float, bias: torch.Tensor | None) -> Routing:
    """DeepSeek-V3's router (HF's ``DeepseekV3TopkRouter``), legend: n tokens, E experts in
    G = `groups` groups of E / G, k = `top_k`.

    Scores s = sigmoid(logits) in fp32; the choice reads s + `bias` (the correction bias,
    `e_score_correction_bias`; None: zeros): each group is scored by the sum of its two best
    experts, only the `top_groups` best groups stay eligible, and the k best eligible experts
    are chosen. Their combine weights are the unbiased s, divided by their sum (+1e-20) when
    `normalize`, times `scaling` (``routed_scaling_factor``). ``probs`` holds s."""
    scores = torch.sigmoid(logits.float())
    choice = scores if bias is None else scores + bias.detach().float()
    n, num_experts = choice.shape
    per_group = choice.view(n, groups, num_experts // groups)
    group_scores = per_group.topk(2, dim=-1)[0].sum(dim=-1)  # [n, G]
    best_groups = torch.topk(group_scores, top_groups, dim=-1)[1]
    eligible = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    eligible = eligible.unsqueeze(-1).expand_as(per_group).reshape(n, num_experts)
    experts = torch.topk(choice.masked_fill(~eligible, float("-inf")), top_k, dim=-1)[1]
    weights = scores.gather(1, experts)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return Routing(scores, (weights * scaling).to(logits.dtype), experts)


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
