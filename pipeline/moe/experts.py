"""Experts as stacked weights, and the dropless dispatch and combine of tokens on one rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Dispatcher", "ExpertOutputs", "LocalDispatcher", "expert_outputs",
           "group_by_expert"]

ExpertOutputs = Callable[[nn.Module, torch.Tensor, list[int]], torch.Tensor]
"""(experts, rows grouped by local expert, rows per expert) -> their outputs, in order."""


def expert_outputs(experts: nn.Module, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows of `tokens` grouped by local expert (``counts[e]`` rows for expert e) through
    their gated FFNs: down(act(gate(x)) · up(x)), with HF's stacked weights
    ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] and its ``act_fn``."""
    gate_up: Any = experts.gate_up_proj
    down: Any = experts.down_proj
    act: Callable[[torch.Tensor], torch.Tensor] = experts.act_fn  # type: ignore[assignment]
    outputs = []
    # An expert with no token still runs on its 0 rows: the output stays in the autograd
    # graph, so every rank of an expert-parallel group runs the same backward all-to-alls.
    for expert, rows in enumerate(torch.split(tokens, counts)):
        gate, up = F.linear(rows, gate_up[expert]).chunk(2, dim=-1)
        outputs.append(F.linear(act(gate) * up, down[expert]))
    return torch.cat(outputs)


def group_by_expert(experts: torch.Tensor, num_experts: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The order that sorts the n·k (token, choice) slots by expert (stable: by token within
    an expert) and the slots per expert ([E]). Slots marked `num_experts` (dropped over
    capacity, `pipeline.moe.capacity`) sort last and are left out of the order."""
    flat = experts.reshape(-1)
    counts = torch.bincount(flat, minlength=num_experts + 1)
    order = torch.argsort(flat, stable=True)
    if counts[num_experts]:
        order = order[:flat.numel() - int(counts[num_experts])]
    return order, counts[:num_experts]


class Dispatcher(Protocol):
    """Sends each token to its k experts and sums their weighted outputs back."""

    def __call__(self, experts: nn.Module, hidden: torch.Tensor, chosen: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor: ...


class LocalDispatcher:
    """Every expert on this rank: sort the slots by expert, run each expert once on its rows,
    scale by the combine weights and add back to the tokens (slots dropped over capacity
    are skipped)."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.expert_outputs: ExpertOutputs = expert_outputs
        """The experts' GEMMs (expert tensor parallelism swaps in its own)."""

    def __call__(self, experts: nn.Module, hidden: torch.Tensor, chosen: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        top_k = chosen.shape[-1]
        order, counts = group_by_expert(chosen, self.num_experts)
        token_of_slot = order // top_k
        out = self.expert_outputs(experts, hidden[token_of_slot], counts.tolist())
        out = out * weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(hidden).index_add_(0, token_of_slot, out.to(hidden.dtype))
