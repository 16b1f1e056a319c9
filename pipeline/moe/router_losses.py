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

Tensor parallelism (`pipeline.interop.hf_moe_tp`, expert tp 1) has each of the t ranks of a
``group`` route 1/t of the microbatch's positions (context parallelism,
`pipeline.interop.hf_moe_context`, each cp rank its own chunks of every sequence). Each loss
is linear in the probabilities
(or the logsumexp²) given the counts c and token totals T, so each rank sums c and T over the
group first (no gradient: one all-reduce of [E + 1] or [b, E + 1] values,
`reduce_token_statistics`) and forms its share over its own tokens with the whole
microbatch's c and T; the shares summed over tp (the head does) are the loss, and each
share's gradient is the loss's gradient with respect to its own tokens' probabilities
(Megatron-Core sums ``tokens_per_expert`` over its tp × cp group the same way).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from pipeline.moe.balancing import MoEBalancing
from pipeline.moe.routing import Routing

__all__ = ["layer_router_loss", "reduce_token_statistics", "sequence_loss", "switch_loss",
           "token_weights", "z_loss"]


def token_weights(mask: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    """[n] fp32: 1 for a real token, 0 for padding (`mask` the [b, s] attention mask)."""
    if mask is None:
        return torch.ones(n, device=device)
    return mask.reshape(-1).to(device, torch.float32)


def reduce_token_statistics(statistics: torch.Tensor, group: ProcessGroup | None
                            ) -> torch.Tensor:
    """`statistics` (counts and token totals, no gradient) summed over `group`, the ranks
    routing the other slices of this microbatch's tokens (None or one rank: as given)."""
    if group is None or dist.get_world_size(group) == 1:
        return statistics
    statistics = statistics.detach().clone()
    dist.all_reduce(statistics, group=group)
    return statistics


def _assignments(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[n, E] fp32: 1 where the token chose the expert among its top-k."""
    one_hot = torch.zeros(experts.shape[0], num_experts, device=experts.device)
    return one_hot.scatter_(1, experts, 1.0)


def switch_loss(probs: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor | None,
                coefficient: float, group: ProcessGroup | None = None) -> torch.Tensor:
    """Megatron-Core's Switch loss of one layer on one microbatch (module docstring);
    `probs` [n, E], `experts` [n, k] the top-k choice, `weights` [n] (None: every token
    real, the common case, in fewer operations: this runs per layer and microbatch);
    `group`: the ranks holding the microbatch's other tokens (this rank's share)."""
    num_experts, top_k = probs.shape[1], experts.shape[1]
    with torch.no_grad():
        if weights is None:
            counts = torch.bincount(experts.reshape(-1), minlength=num_experts).to(probs.dtype)
            tokens = counts.new_full((1,), float(probs.shape[0]))
        else:
            counts = (_assignments(experts, num_experts) * weights.unsqueeze(-1)).sum(0)
            tokens = weights.sum().reshape(1)
        summed = reduce_token_statistics(torch.cat([counts, tokens]), group)
        counts, tokens = summed[:-1], summed[-1]
    prob_sums = probs.sum(0) if weights is None else (probs * weights.unsqueeze(-1)).sum(0)
    return torch.dot(counts, prob_sums) * (coefficient * num_experts / top_k) \
        / tokens.clamp_min(1.0) ** 2


def sequence_loss(probs: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                  sequences: int, coefficient: float, group: ProcessGroup | None = None
                  ) -> torch.Tensor:
    """DeepSeek's sequence-level loss of one layer on one microbatch of `sequences` rows
    (module docstring); tokens are in row-major [b, s] order (`group`: the ranks holding
    the other positions of the same rows; this rank's share)."""
    num_experts, top_k = probs.shape[1], experts.shape[1]
    w = weights.reshape(sequences, -1, 1)  # [b, s, 1]
    with torch.no_grad():
        counts = (_assignments(experts, num_experts).reshape(sequences, -1, num_experts)
                  * w).sum(1)  # [b, E]
        summed = reduce_token_statistics(torch.cat([counts, w.sum(1)], dim=-1), group)
        counts, per_sequence = summed[:, :-1], summed[:, -1:]  # c_{j,e}, T_j [b, 1]
        fractions = counts * num_experts / (top_k * per_sequence.clamp_min(1.0))
    mean_probs = (probs.reshape(sequences, -1, num_experts) * w).sum(1) \
        / per_sequence.clamp_min(1.0)  # [b, E]
    real = (per_sequence.squeeze(-1) > 0).float()
    per_row = (fractions * mean_probs).sum(-1) * real
    return coefficient * per_row.sum() / real.sum().clamp_min(1.0)


def z_loss(logits: torch.Tensor, weights: torch.Tensor, coefficient: float,
           group: ProcessGroup | None = None) -> torch.Tensor:
    """ST-MoE's router z-loss of one layer on one microbatch (module docstring; `group`:
    the ranks holding the microbatch's other tokens)."""
    squared = torch.logsumexp(logits.float(), dim=-1) ** 2
    with torch.no_grad():
        tokens = reduce_token_statistics(weights.sum().reshape(1), group)[0]
    return coefficient * (squared * weights).sum() / tokens.clamp_min(1.0)


def layer_router_loss(balancing: MoEBalancing, routing: Routing, logits: torch.Tensor,
                      mask: torch.Tensor | None, sequences: int,
                      group: ProcessGroup | None = None) -> torch.Tensor | None:
    """This layer's census-free losses on one microbatch (0-d fp32), or None when the
    balancing adds none: `logits` [n, E], `mask` the [b, s] attention mask or None; `group`
    the ranks routing the microbatch's other tokens (tensor parallelism; None: none)."""
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
