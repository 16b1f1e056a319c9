"""A mixture-of-experts feed-forward: router, experts, optional gated shared expert."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.moe.balance_loss import BalanceLoss
from pipeline.moe.capacity import DropPolicy, expert_capacity, mark_dropped
from pipeline.moe.experts import Dispatcher, LocalDispatcher
from pipeline.moe.routing import route, router_statistics

__all__ = ["MoEFeedForward", "RouterConfig"]


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """How a family routes."""

    num_experts: int
    """E, the routed experts of each MoE layer."""
    top_k: int
    """Experts per token."""
    normalize_top_k: bool
    """Divide the k chosen probabilities by their sum (Mixtral always; Qwen-MoE's
    ``norm_topk_prob``)."""
    capacity_factor: float | None = None
    """None: dropless. Otherwise each expert takes at most ceil(capacity_factor · n · k / E)
    of the n tokens a rank routes per microbatch and the rest of its slots are dropped
    (Megatron-Core's ``--moe-expert-capacity-factor``; `pipeline.moe.capacity`)."""
    drop_policy: DropPolicy = "probs"
    """Which slots an over-full expert keeps: "probs" (the largest combine weights,
    Megatron-Core's default) or "position" (the first tokens)."""

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in 1..{self.num_experts} (the "
                             "number of experts); lower num_experts_per_tok")
        factor = self.capacity_factor
        if factor is not None and (isinstance(factor, bool) or not isinstance(
                factor, (int, float)) or not 0 < factor < float("inf")):
            raise ValueError(f"capacity_factor must be a positive number or None (dropless), "
                             f"got {factor!r}; Megatron-Core's runs use 1.0 to 2.0")
        if self.drop_policy not in ("probs", "position"):
            raise ValueError(f"drop_policy must be 'probs' or 'position', got "
                             f"{self.drop_policy!r}")


class MoEFeedForward(nn.Module):
    """Tokens through their top-k experts (plus a sigmoid-gated shared expert when given).

    The submodules keep HF's names (``gate``: the router's [E, H] weight; ``experts``:
    stacked ``gate_up_proj`` / ``down_proj``; ``shared_expert``, ``shared_expert_gate``), so
    the parameters are HF's. `dispatcher` decides where the experts run: all here
    (`LocalDispatcher`) or sharded over an expert-parallel group
    (`pipeline.moe.expert_parallel`)."""

    def __init__(self, config: RouterConfig, gate: nn.Module, experts: nn.Module, *,
                 shared_expert: nn.Module | None = None,
                 shared_expert_gate: nn.Module | None = None,
                 balance: BalanceLoss | None = None) -> None:
        super().__init__()
        self.config = config
        self.gate = gate
        self.experts = experts
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate
        self.balance = balance
        self.dispatcher: Dispatcher = LocalDispatcher(config.num_experts)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """[b, s, H] (and the [b, s] attention mask) -> the [b, s, H] output and this
        layer's share of the load-balancing loss (0-d; 0 when the family adds none)."""
        shape = hidden.shape
        tokens = hidden.reshape(-1, shape[-1])
        router: Any = self.gate.weight
        routing = route(F.linear(tokens, router), self.config.top_k,
                        normalize=self.config.normalize_top_k)
        chosen = routing.experts
        config = self.config
        if config.capacity_factor is not None:
            capacity = expert_capacity(tokens.shape[0], config.top_k, config.num_experts,
                                       config.capacity_factor)
            chosen = mark_dropped(chosen, routing.weights, config.num_experts, capacity,
                                  config.drop_policy)
        out = self.dispatcher(self.experts, tokens, chosen, routing.weights)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert(tokens)
            out = out + torch.sigmoid(self.shared_expert_gate(tokens)) * shared
        share = (tokens.new_zeros((), dtype=torch.float32) if self.balance is None
                 else self.balance.share(router_statistics(routing, mask)))
        return out.reshape(shape), share
