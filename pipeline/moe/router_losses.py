"""The census-free router losses of one MoE layer on one microbatch: Megatron-Core's
per-microbatch Switch loss, DeepSeek's sequence-level loss, and ST-MoE's router z-loss.

Legend: n tokens of the microbatch (b sequences of s positions, n = b·s), E experts, k experts
per token, w_t the token's weight (1, or 0 for padding), T = Σ_t w_t the real tokens,
p_{t,e} the router's softmax probability, c_e = Σ_t w_t · [e among t's top-k]. Padding
counts in none of them, as in Megatron-Core's ``padding_mask`` forms.

    switch (Megatron-Core ``switch_load_balancing_loss_func``, on the microbatch's tokens):
        coef · E / (k · T²) · Σ_e c_e · Σ_t w_t p_{t,e}
    sequence (DeepSeek-V2/V3 ``seq_aux``; Megatron-Core ``sequence_load_balancing_loss_func``):
        coef · mean over sequences j of Σ_e f_{j,e} · P_{j,e},
        f_{j,e} = E / (k · T_j) · c_{j,e},   P_{j,e} = Σ_{t in j} w_t p_{t,e} / T_j
    z (ST-MoE eq. 5; Megatron-Core ``z_loss_func``):
        coef · Σ_t w_t · logsumexp_e(logits_{t,e})² / T

Each is a per-layer, per-microbatch loss; the layer's share carried to the loss is their sum
(`pipeline.moe.balancing`). A microbatch (or sequence) with no real token adds 0.

`group`: the ranks splitting one microbatch's tokens between them (context parallelism:
each cp rank routes its own chunks of every sequence). The counts c_e, c_{j,e} and the
token counts T, T_j are then summed over it (no gradient), and each rank's result is its
tokens' part of the microbatch's loss (their probabilities, z-terms), so the parts over
the group add up to the loss of the whole microbatch (Megatron-Core reduces
``tokens_per_expert`` over its tp × cp group the same way).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from pipeline.moe.balancing import MoEBalancing
from pipeline.moe.routing import Routing

__all__ = ["layer_router_loss", "sequence_loss", "summed_over", "switch_loss", "token_weights",
           "z_loss"]


def token_weights(mask: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    """[n] fp32: 1 for a real token, 0 for padding (`mask` the [b, s] attention mask)."""
    if mask is None:
        return torch.ones(n, device=device)
    return mask.reshape(-1).to(device, torch.float32)


def summed_over(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """`tensor` (a count, no gradient) summed over `group` (None: as it is)."""
    if group is None:
        return tensor
    total = tensor.detach().clone()
    dist.all_reduce(total, group=group)
    return total


def _assignments(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[n, E] fp32: 1 where the token chose the expert among its top-k."""
    one_hot = torch.zeros(experts.shape[0], num_experts, device=experts.device)
    return one_hot.scatter_(1, experts, 1.0)


def switch_loss(probs: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor | None,
                coefficient: float, group: ProcessGroup | None = None) -> torch.Tensor:
    """Megatron-Core's Switch loss of one layer on one microbatch (module docstring);
    `probs` [n, E], `experts` [n, k] the top-k choice, `weights` [n] (None: every token
    real, the common case, in fewer operations: this runs per layer and microbatch);
    `group`: the ranks sharing the microbatch's tokens (module docstring)."""
    num_experts, top_k = probs.shape[1], experts.shape[1]
    if weights is None:
        with torch.no_grad():
            counts = torch.bincount(experts.reshape(-1), minlength=num_experts)
            counts = summed_over(counts, group)
        routed = probs.shape[0] if group is None else int(summed_over(
            torch.tensor(probs.shape[0], device=probs.device), group))
        scale = coefficient * num_experts / (top_k * routed ** 2)
        return torch.dot(counts.to(probs.dtype), probs.sum(0)) * scale
    tokens = summed_over(weights.sum(), group)
    with torch.no_grad():
        counts = summed_over(
            (_assignments(experts, num_experts) * weights.unsqueeze(-1)).sum(0), group)
    prob_sums = (probs * weights.unsqueeze(-1)).sum(0)
    return torch.dot(counts, prob_sums) * (coefficient * num_experts / top_k) \
        / tokens.clamp_min(1.0) ** 2


def sequence_loss(probs: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                  sequences: int, coefficient: float, group: ProcessGroup | None = None
                  ) -> torch.Tensor:
    """DeepSeek's sequence-level loss of one layer on one microbatch of `sequences` rows
    (module docstring); tokens are in row-major [b, s] order (at cp, each row this rank's
    chunks of the sequence; `group` the cp group)."""
    num_experts, top_k = probs.shape[1], experts.shape[1]
    w = weights.reshape(sequences, -1, 1)  # [b, s, 1]
    per_sequence = summed_over(w.sum(1), group)  # [b, 1]: T_j
    with torch.no_grad():
        counts = summed_over((_assignments(experts, num_experts).reshape(
            sequences, -1, num_experts) * w).sum(1), group)  # [b, E]
        fractions = counts * num_experts / (top_k * per_sequence.clamp_min(1.0))
    mean_probs = (probs.reshape(sequences, -1, num_experts) * w).sum(1) \
        / per_sequence.clamp_min(1.0)  # [b, E]
    real = (per_sequence.squeeze(-1) > 0).float()
    per_row = (fractions * mean_probs).sum(-1) * real
    return coefficient * per_row.sum() / real.sum().clamp_min(1.0)


def z_loss(logits: torch.Tensor, weights: torch.Tensor, coefficient: float,
           group: ProcessGroup | None = None) -> torch.Tensor:
    """ST-MoE's router z-loss of one layer on one microbatch (module docstring)."""
    squared = torch.logsumexp(logits.float(), dim=-1) ** 2
    tokens = summed_over(weights.sum(), group)
    return coefficient * (squared * weights).sum() / tokens.clamp_min(1.0)


def layer_router_loss(balancing: MoEBalancing, routing: Routing, logits: torch.Tensor,
                      mask: torch.Tensor | None, sequences: int,
                      group: ProcessGroup | None = None) -> torch.Tensor | None:
    """This layer's census-free losses on one microbatch (0-d fp32), or None when the
    balancing adds none: `logits` [n, E], `mask` the [b, s] attention mask or None,
    `group` the ranks sharing the microbatch's tokens (module docstring)."""
    terms: list[torch.Tensor] = []
    coefficient = float(balancing.aux_loss_coef or 0.0)
    weights = token_weights(mask, logits.shape[0], logits.device)
    if balancing.method == "microbatch":
        terms.append(switch_loss(routing.probs, routing.experts,
                                 None if mask is None else weights, coefficient, group))
    elif balancing.method == "sequence":
        terms.append(sequence_loss(routing.probs, routing.experts, weights, sequences,
                                   coefficient, group))
    if balancing.router_z_loss_coef > 0:
        terms.append(z_loss(logits, weights, balancing.router_z_loss_coef, group))
    if not terms:
        return None
    return terms[0] if len(terms) == 1 else torch.stack(terms).sum()
