"""A mixture-of-experts feed-forward: router, experts, optional gated shared expert."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from pipeline.moe.balance_loss import BalanceLoss
from pipeline.moe.balancing import MoEBalancing
from pipeline.moe.capacity import DropPolicy, expert_capacity, mark_dropped
from pipeline.moe.experts import Dispatcher, LocalDispatcher
from pipeline.moe.router_losses import layer_router_loss, token_weights
from pipeline.moe.routing import route, route_grouped, router_statistics

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
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    """"softmax": `pipeline.moe.routing.route`; "sigmoid": DeepSeek-V3's group-limited
    sigmoid router (`pipeline.moe.routing.route_grouped`), which the fields below shape."""
    groups: int = 1
    """The expert groups (``n_group``; sigmoid: DeepSeek-V3's, softmax: DeepSeek-V2's
    ``group_limited_greedy`` when > 1); E must divide by it."""
    top_groups: int = 1
    """The groups whose experts stay eligible per token (``topk_group``)."""
    scaling: float = 1.0
    """The combine weights' factor (``routed_scaling_factor``)."""
    fp32_logits: bool = False
    """softmax: the router's logits computed in fp32 (DeepSeek-V2's router; the sigmoid
    router always does), not in the tokens' dtype (Mixtral's, Qwen's)."""

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in 1..{self.num_experts} (the "
                             "number of experts); lower num_experts_per_tok")
        if self.scoring == "sigmoid" or self.groups != 1:
            self._check_groups()
        factor = self.capacity_factor
        if factor is not None and (isinstance(factor, bool) or not isinstance(
                factor, (int, float)) or not 0 < factor < float("inf")):
            raise ValueError(f"capacity_factor must be a positive number or None (dropless), "
                             f"got {factor!r}; Megatron-Core's runs use 1.0 to 2.0")
        if self.drop_policy not in ("probs", "position"):
            raise ValueError(f"drop_policy must be 'probs' or 'position', got "
                             f"{self.drop_policy!r}")

    def _check_groups(self) -> None:
        experts, groups, top = self.num_experts, self.groups, self.top_groups
        if groups < 1 or experts % groups:
            raise ValueError(f"n_group={groups} must be >= 1 and divide the {experts} routed "
                             "experts (each group holds E / n_group)")
        if self.scoring == "sigmoid" and experts // groups < 2:
            raise ValueError(f"n_group={groups} leaves {experts // groups} expert per group; "
                             "groups are scored by their two best experts: use n_group <= "
                             f"{experts // 2}")
        if not 1 <= top <= groups:
            raise ValueError(f"topk_group={top} must be in 1..n_group={groups}")
        if self.top_k > top * (experts // groups):
            raise ValueError(f"num_experts_per_tok={self.top_k} exceeds the "
                             f"{top * (experts // groups)} experts of topk_group={top} "
                             f"groups; raise topk_group or lower num_experts_per_tok")


class MoEFeedForward(nn.Module):
    """Tokens through their top-k experts (plus a sigmoid-gated shared expert when given).

    The submodules keep HF's names (``gate``: the router's [E, H] weight; ``experts``:
    stacked ``gate_up_proj`` / ``down_proj``; ``shared_expert``, ``shared_expert_gate``), so
    the parameters are HF's. `dispatcher` decides where the experts run: all here
    (`LocalDispatcher`) or sharded over an expert-parallel group
    (`pipeline.moe.expert_parallel`).

    Load balancing (`pipeline.moe.balancing`): `balance`, HF's whole-batch loss (the census
    handle shared by the model's layers), or `balancing`'s census-free losses, or its
    aux-free expert bias (buffers ``expert_bias``, persistent, and ``expert_load``, kept in
    fp32; `pipeline.moe.expert_bias`). `jitter_noise` (Mixtral's ``router_jitter_noise``):
    in training, the tokens are multiplied by noise uniform in [1 - j, 1 + j] before the
    router and the experts, as HF's Mixtral does."""

    def __init__(self, config: RouterConfig, gate: nn.Module, experts: nn.Module, *,
                 shared_expert: nn.Module | None = None,
                 shared_expert_gate: nn.Module | None = None,
                 shared_experts: nn.Module | None = None,
                 balance: BalanceLoss | None = None,
                 balancing: MoEBalancing | None = None, jitter_noise: float = 0.0) -> None:
        super().__init__()
        self.config = config
        self.gate = gate
        self.experts = experts
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate
        if shared_experts is not None:  # DeepSeek's, ungated, under HF's name
            self.shared_experts = shared_experts
        self.balance = balance
        self.balancing = balancing or MoEBalancing(method="none")
        self.jitter_noise = jitter_noise
        self.dispatcher: Dispatcher = LocalDispatcher(config.num_experts)
        self.token_group: ProcessGroup | None = None
        """The ranks that split each microbatch's tokens with this one (the tp group at
        tp × ep, the cp group at cp × ep; None: it routes them all): the census-free losses
        sum their expert and token counts over it (`pipeline.moe.router_losses`)."""
        aux_free = self.balancing.method == "aux-free"
        # a router holding its own correction bias (DeepSeek-V3's e_score_correction_bias,
        # in HF's checkpoint) is the aux-free bias: no second copy
        own = aux_free and self._correction_bias() is None
        self.register_buffer("expert_bias", torch.zeros(config.num_experts)
                             if own else None)
        self.register_buffer("expert_load", torch.zeros(config.num_experts)
                             if aux_free else None, persistent=False)

    def _correction_bias(self) -> torch.Tensor | None:
        bias = getattr(self.gate, "e_score_correction_bias", None)
        return bias if isinstance(bias, torch.Tensor) else None

    def _selection_bias(self) -> torch.Tensor | None:
        """The bias added to the scores for the top-k choice (None: none)."""
        own = self.expert_bias
        return own if isinstance(own, torch.Tensor) else self._correction_bias()

    @property
    def bias(self) -> torch.Tensor:
        """The aux-free expert bias [E] (refused when the layer balances otherwise)."""
        bias = self._selection_bias() if self.balancing.method == "aux-free" else None
        if not isinstance(bias, torch.Tensor):
            raise AttributeError("this MoE layer has no expert bias (balancing method "
                                 f"{self.balancing.method!r}, not 'aux-free')")
        return bias

    @property
    def load(self) -> torch.Tensor:
        """The aux-free top-k assignments [E] of this step's training forwards so far."""
        load = self.expert_load
        if not isinstance(load, torch.Tensor):
            raise AttributeError("this MoE layer counts no load (balancing method "
                                 f"{self.balancing.method!r}, not 'aux-free')")
        return load

    def _apply(self, fn: Any, recurse: bool = True) -> MoEFeedForward:
        # the bias moves in steps of ~1e-3: keep it (and the load) in fp32 when the module
        # is cast to half precision, as Megatron-Core keeps its expert_bias
        super()._apply(fn, recurse)
        for owner, name in ((self, "expert_bias"), (self, "expert_load"),
                            (self.gate, "e_score_correction_bias")):
            buffer = owner._buffers.get(name)
            if buffer is not None and buffer.dtype != torch.float32:
                owner._buffers[name] = buffer.float()
        return self

    def two_batch_problem(self) -> str | None:
        """Why a two-batch forward (halves of a microbatch by rows) would change this
        layer's result (None if it would not): per-microbatch losses are not sums over
        rows, and jitter draws per half."""
        if self.balancing.adds_aux_loss or self.balancing.router_z_loss_coef > 0:
            return (f"its {self.balancing.method!r} balancing (z-loss coef "
                    f"{self.balancing.router_z_loss_coef}) is computed per microbatch, which "
                    "each half would compute on its own rows; use 'hf-batch', 'aux-free' or "
                    "'none' with two-batch overlap")
        if self.jitter_noise > 0:
            return (f"its router_jitter_noise={self.jitter_noise} noise each half would "
                    "draw anew")
        return None

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """[b, s, H] (and the [b, s] attention mask) -> the [b, s, H] output and this
        layer's share of the load-balancing loss (0-d; 0 when the family adds none)."""
        shape = hidden.shape
        tokens = hidden.reshape(-1, shape[-1])
        if self.training and self.jitter_noise > 0:
            noise = torch.empty_like(tokens).uniform_(1.0 - self.jitter_noise,
                                                      1.0 + self.jitter_noise)
            tokens = tokens * noise
        router: Any = self.gate.weight
        bias = self._selection_bias()
        config = self.config
        if config.scoring == "sigmoid":  # HF's DeepSeek-V3 router runs in fp32
            logits = F.linear(tokens.float(), router.float())
            routing = route_grouped(logits, config.top_k, groups=config.groups,
                                    top_groups=config.top_groups,
                                    normalize=config.normalize_top_k, scaling=config.scaling,
                                    bias=bias)
        else:
            logits = (F.linear(tokens.float(), router.float()) if config.fp32_logits
                      else F.linear(tokens, router))
            routing = route(logits, config.top_k, normalize=config.normalize_top_k, bias=bias,
                            groups=config.groups, top_groups=config.top_groups,
                            scaling=config.scaling)
        if self.balancing.method == "aux-free" and self.training:
            self._count_load(routing.experts, mask)
        chosen = routing.experts
        if config.capacity_factor is not None:
            capacity = expert_capacity(tokens.shape[0], config.top_k, config.num_experts,
                                       config.capacity_factor)
            chosen = mark_dropped(chosen, routing.weights, config.num_experts, capacity,
                                  config.drop_policy)
        out = self.dispatcher(self.experts, tokens, chosen, routing.weights)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert(tokens)
            out = out + torch.sigmoid(self.shared_expert_gate(tokens)) * shared
        shared_experts = getattr(self, "shared_experts", None)
        if shared_experts is not None:
            out = out + shared_experts(tokens)
        return out.reshape(shape), self._share(routing, logits, mask, shape[0])

    def _share(self, routing: Any, logits: torch.Tensor, mask: torch.Tensor | None,
               sequences: int) -> torch.Tensor:
        """This layer's share of the balancing loss on this microbatch (0-d fp32)."""
        share = logits.new_zeros((), dtype=torch.float32)
        if self.balance is not None:
            share = share + self.balance.share(router_statistics(routing, mask))
        losses = layer_router_loss(self.balancing, routing, logits, mask, sequences,
                                   self.token_group)
        return share if losses is None else share + losses

    def _count_load(self, experts: torch.Tensor, mask: torch.Tensor | None) -> None:
        weights = token_weights(mask, experts.shape[0], experts.device)
        with torch.no_grad():
            self.load.index_add_(0, experts.reshape(-1),
                                 weights.repeat_interleave(experts.shape[1]))
