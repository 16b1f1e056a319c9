"""Expert capacity: the optional token dropping of a capacity factor (dropless without one).

The convention is Megatron-Core's (``--moe-expert-capacity-factor``, with its default
``--moe-token-drop-policy probs``; `megatron.core.transformer.moe.moe_utils.
topk_softmax_with_capacity`): one MoE layer routing n tokens top-k over E experts gives each
expert

    capacity C = ceil(capacity_factor · n · k / E)

slots, n being the tokens this rank routes in this microbatch (its own, before any
dispatch: Megatron computes C from the router's local logits). An expert chosen by more than
C of them keeps the C with the largest combine weights (policy "probs"; ties: the earlier
token) or the first C in token order (policy "position"); the dropped (token, expert) slots
contribute nothing, so the token keeps only its other experts' outputs, or none (the
decoder's residual carries it on). Because C and the choice depend only on the rank's own
tokens, the same slots drop whether an expert runs here or on another rank of the ep group.
Unlike Megatron there is no padding to capacity (``--moe-pad-expert-input-to-capacity``):
the dispatch keeps variable split sizes.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

__all__ = ["DropPolicy", "expert_capacity", "mark_dropped"]

DropPolicy = Literal["probs", "position"]
"""Which slots an over-full expert keeps: the largest combine weights, or the first tokens."""


def expert_capacity(num_tokens: int, top_k: int, num_experts: int,
                    capacity_factor: float) -> int:
    """Slots per expert: ceil(capacity_factor · tokens · top_k / experts)."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def mark_dropped(chosen: torch.Tensor, weights: torch.Tensor, num_experts: int,
                 capacity: int, policy: DropPolicy) -> torch.Tensor:
    """`chosen` ([n, k] expert indices) with each slot over its expert's capacity replaced
    by `num_experts`, the index the dispatchers skip."""
    flat = chosen.reshape(-1)
    # slots in the order an expert keeps them: by expert, then (probs) by falling weight,
    # ties and "position" by slot index, i.e. token order (stable sorts)
    order = torch.arange(flat.numel(), device=flat.device)
    if policy == "probs":
        order = torch.argsort(-weights.detach().reshape(-1).float(), stable=True)
    order = order[torch.argsort(flat[order], stable=True)]
    counts = torch.bincount(flat, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    dropped = torch.zeros_like(flat, dtype=torch.bool)
    dropped[order] = rank_in_expert >= capacity
    return torch.where(dropped, torch.full_like(flat, num_experts), flat).view_as(chosen)
