"""A mixture-of-experts MLP's shape: its experts, top-k routing, shared experts and which
blocks have one, and the parameters and FLOPs of such a block's MLP (Mixtral, Qwen2-MoE,
Qwen3-MoE as transformers builds them)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.planner.errors import PlanError
from pipeline.planner.node_limited import ExpertRouting, routing_problems

__all__ = ["MOE_KEYS", "ExpertShape", "RoutedExperts", "check_routing_imbalance"]

MOE_KEYS = ("experts", "topk", "expert_ffn", "shared_ffn", "shared_gate", "sparse_step",
            "dense_layers", "expert_groups", "topk_groups")
"""The model-string / shape-file keys of `ExpertShape` (`shape_parse.parse_shape`)."""


@dataclass(frozen=True, kw_only=True)
class ExpertShape:
    """The MLP of a MoE block: a router (h → E, no bias), E experts of the block's MLP kind
    with width `expert_ffn` each (SwiGLU: gate, up h×f_e, down f_e×h), of which each token
    runs `topk`, and optionally a shared expert every token runs (width `shared_ffn`) whose
    output a sigmoid gate (h → 1) scales (Qwen2-MoE). Notation: E experts, k top-k, f_e the
    expert width, f_s the shared width, h hidden."""

    experts: int
    """E: routed experts in each MoE block (Mixtral num_local_experts, Qwen num_experts)."""
    topk: int
    """k: experts each token is routed to (num_experts_per_tok)."""
    expert_ffn: int
    """f_e: one expert's MLP width (Mixtral intermediate_size, Qwen moe_intermediate_size)."""
    shared_ffn: int = 0
    """f_s: the shared expert's width (Qwen2-MoE shared_expert_intermediate_size); 0: none."""
    shared_gate: bool = False
    """The shared expert's output is scaled by sigmoid(x·w), w of h (Qwen2-MoE)."""
    sparse_step: int = 1
    """Block i (from 0) has experts when (i + 1) is a multiple of this (Qwen's
    decoder_sparse_step) and i is not in `dense_layers`; the others a dense MLP."""
    dense_layers: tuple[int, ...] = ()
    """Blocks kept dense whatever the step (Qwen's mlp_only_layers)."""
    expert_groups: int = 1
    """G: the experts in G equal groups for group-limited routing (DeepSeek's n_group,
    Megatron-Core's --moe-router-num-groups); 1: none (`node_limited.ExpertRouting`)."""
    topk_groups: int = 1
    """M: the groups a token's k experts may come from (DeepSeek's topk_group,
    Megatron-Core's --moe-router-group-topk; DeepSeek-V3: 4 of 8, one group a node)."""

    def __post_init__(self) -> None:
        problems = []
        for name in ("experts", "topk", "expert_ffn", "sparse_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name}={value!r} must be a whole number >= 1")
        if isinstance(self.shared_ffn, bool) or not isinstance(self.shared_ffn, int) \
                or self.shared_ffn < 0:
            problems.append(f"shared_ffn={self.shared_ffn!r} must be a whole number >= 0 "
                            "(0: no shared expert)")
        if self.shared_gate and not self.shared_ffn:
            problems.append("shared_gate=true needs a shared expert (shared_ffn >= 1)")
        if not isinstance(self.dense_layers, tuple) or any(
                isinstance(i, bool) or not isinstance(i, int) or i < 0
                for i in self.dense_layers):
            problems.append(f"dense_layers={self.dense_layers!r} must be block indices >= 0")
        if not problems and self.topk > self.experts:
            problems.append(f"topk={self.topk} must be at most experts={self.experts} (each "
                            "token is routed to k distinct experts); lower topk")
        if not problems:
            problems = routing_problems(self.experts, self.topk, self.expert_groups,
                                        self.topk_groups)
        if problems:
            raise PlanError("mixture-of-experts shape: " + "; ".join(problems))

    @property
    def routing(self) -> ExpertRouting:
        """How its tokens pick experts (`node_limited`: the all-to-all's cross-node bytes)."""
        return ExpertRouting(self.experts, self.topk, self.expert_groups, self.topk_groups)

    def model_string(self) -> str:
        """Its model-string keys (`shape_parse.parse_shape` reads them back)."""
        values = {"experts": self.experts, "topk": self.topk, "expert_ffn": self.expert_ffn,
                  "shared_ffn": self.shared_ffn, "shared_gate": str(self.shared_gate).lower(),
                  "sparse_step": self.sparse_step,
                  "dense_layers": ";".join(map(str, self.dense_layers)),
                  "expert_groups": self.expert_groups, "topk_groups": self.topk_groups}
        defaults = {"shared_ffn": 0, "shared_gate": "false", "sparse_step": 1,
                    "dense_layers": "", "expert_groups": 1, "topk_groups": 1}
        return ",".join(f"{key}={value}" for key, value in values.items()
                        if defaults.get(key, None) != value)

    def is_sparse(self, index: int) -> bool:
        """Whether block `index` (from 0) has experts (HF's Qwen2/3-MoE rule; Mixtral:
        every block)."""
        return index not in self.dense_layers and (index + 1) % self.sparse_step == 0

    @property
    def active_ffn(self) -> int:
        """MLP width one token runs through: k·f_e + f_s (its FLOPs and the activations it
        keeps are those of a dense MLP this wide)."""
        return self.topk * self.expert_ffn + self.shared_ffn

    def expert_parameters(self, hidden: int, matrices: int) -> int:
        """Parameters of a block's E routed experts: E · matrices · h · f_e (split over ep)."""
        return self.experts * matrices * hidden * self.expert_ffn

    def dense_parameters(self, hidden: int, matrices: int) -> int:
        """Parameters of a MoE block's MLP that every ep rank holds: the router h·E, the
        shared expert matrices · h · f_s and its gate h."""
        return (hidden * self.experts + matrices * hidden * self.shared_ffn
                + (hidden if self.shared_gate else 0))

    def router_flops_per_token(self, hidden: int) -> int:
        """Forward FLOPs per token beyond the k·f_e + f_s wide MLP: the router's logits and
        the shared expert's gate, 2 per multiply-add."""
        return 2 * (hidden * self.experts + (hidden if self.shared_gate else 0))

    def label(self) -> str:
        shared = f"+{self.shared_ffn}" if self.shared_ffn else ""
        grouped = (f" groups{self.topk_groups}/{self.expert_groups}"
                   if self.expert_groups > 1 else "")
        return f" moe={self.experts}x{self.expert_ffn} top{self.topk}{shared}{grouped}"


def check_routing_imbalance(value: object) -> float | None:
    """`value` as a busiest-rank load factor (a finite number >= 1, or None: the sampling
    floor, `routing_load.busiest_rank_ratio`), or a one-line `PlanError`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not 1.0 <= value < float("inf"):
        raise PlanError(f"routing imbalance {value!r} must be a number >= 1: the busiest "
                        "expert-parallel rank's routed tokens over the mean (1.0: perfectly "
                        "even); leave it out for the sampling floor of a balanced router")
    return float(value)


@dataclass(frozen=True, kw_only=True)
class RoutedExperts:
    """What the kernel model needs of a MoE block's MLP on one rank (`expert_kernels`): E
    routed experts of width f_e split over `ep` ranks, top-k, a shared expert of width f_s
    (0: none), and the busiest ep rank's load over the mean (`imbalance`; None: the
    sampling floor of a balanced router, `routing_load.busiest_rank_ratio`), each rank
    routing its s/cp tokens' share (`cp`)."""

    experts: int
    topk: int
    expert_ffn: int
    shared_ffn: int = 0
    ep: int = 1
    imbalance: float | None = None
    cp: int = 1
    """Context-parallel ranks splitting each sequence: each routes its own s/cp tokens
    (`pipeline.interop.hf_moe_context`)."""
    expert_tp: int = 1
    """Expert tensor parallelism: 1 (each expert whole on its ep rank) or t (each expert's
    gate/up column-split and down row-split over the tp group, which gathers its routed
    rows: `pipeline.moe.expert_tensor_parallel`)."""

    def __post_init__(self) -> None:
        if self.ep < 1 or self.experts % self.ep:
            raise PlanError(f"ep={self.ep} must be >= 1 and divide the {self.experts} "
                            "experts (each ep rank holds E / ep)")
        for name in ("cp", "expert_tp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{name}={value!r} must be a whole number >= 1")
        check_routing_imbalance(self.imbalance)

    @property
    def local_experts(self) -> int:
        """E / ep: the experts one rank holds and runs."""
        return self.experts // self.ep
