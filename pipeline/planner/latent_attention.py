"""Multi-head latent attention (MLA, DeepSeek-V2 / V3): its shape, parameters, FLOPs, GEMMs
on a tensor-parallel rank and the activations it keeps, as this engine and Megatron-Core
run it.

Notation (DeepSeek-V2 paper, arXiv 2405.04434, section 2.1; HF's config keys in brackets):
h hidden, a heads, r_q the query's latent rank [q_lora_rank] (0: no query latent, a
direct h → a·d_qk projection: V2-Lite), r_kv the key/value latent rank [kv_lora_rank],
d_n the per-head key/query part without positions [qk_nope_head_dim], d_r the rotary part
[qk_rope_head_dim], one d_r-wide key shared by all heads, d_v the value head
[v_head_dim]; d_qk = d_n + d_r, s sequence, t tensor parallel.

One block's attention (HF's `DeepseekV3Attention`, transformers 5; Megatron-Core's
`MLASelfAttention`, megatron/core/transformer/multi_latent_attention.py, NVIDIA/Megatron-LM
commit d98e8a64ddf34856e74b24714e3bedb2f5a39553)::

    x ── q_a  h × r_q ── norm(r_q) ── q_b  r_q × a·d_qk ──────── Q (a heads of d_qk)
      │  (or q_proj h × a·d_qk without a query latent)
      └─ kv_a h × (r_kv + d_r) ┬ norm(r_kv) ── kv_b r_kv × a·(d_n + d_v) ┬ K_nope, V
                               └ k_rope (d_r, rotary, shared by the a heads) ┘ K = [K_nope, k_rope]
    softmax(Q·Kᵀ / √d_qk)·V ── o  a·d_v × h

Over t ranks both split it by heads (`pipeline.interop.hf_tp_split.split_latent_attention`;
Megatron-Core's linear_q_up_proj / linear_kv_up_proj column-parallel, linear_proj
row-parallel): q_b (or q_proj) and kv_b keep their a/t heads' rows, o their columns; the
down-projections q_a and kv_a and both norms are whole on every rank, their gradients summed
over tp (Megatron-Core's TE spec builds them as `TELinear(parallel_mode="duplicated")`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pipeline.planner.errors import PlanError

__all__ = ["LATENT_KEYS", "LatentAttention", "LatentGemm", "latent_shape_problems"]

LATENT_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
               "v_head_dim")
"""The model-string / shape-file keys of `LatentAttention` (`shape_parse.parse_shape`): HF's
DeepSeek config names."""

GemmKind = Literal["replicated", "column", "row"]


@dataclass(frozen=True)
class LatentGemm:
    """One of MLA's weight matrices as a tp rank runs it: Y[T × outputs] = X[T × inputs]·W,
    `kind` replicated (whole on every rank), column (its outputs split by heads) or row
    (its inputs split by heads, the output all-reduced)."""

    name: str
    kind: GemmKind
    inputs: int
    outputs: int


@dataclass(frozen=True, kw_only=True)
class LatentAttention:
    """MLA's own sizes (the module docstring's legend); the heads and hidden size are the
    transformer's."""

    kv_lora_rank: int
    """r_kv: the latent keys and values are projected down to."""
    qk_nope_head_dim: int
    """d_n: each head's query / key part without rotary positions."""
    qk_rope_head_dim: int
    """d_r: each head's rotary query part, and the one rotary key all heads share."""
    v_head_dim: int
    """d_v: each head's value (and attention output) size."""
    q_lora_rank: int = 0
    """r_q: the query's latent rank; 0: none, a direct q_proj h × a·d_qk (DeepSeek-V2-Lite's
    q_lora_rank null)."""

    def __post_init__(self) -> None:
        problems = []
        for name in LATENT_KEYS:
            value = getattr(self, name)
            least = 0 if name == "q_lora_rank" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                problems.append(f"{name}={value!r} must be a whole number >= {least}"
                                + (" (0: a direct query projection)" if least == 0 else ""))
        if problems:
            raise PlanError("multi-head latent attention: " + "; ".join(problems))

    @property
    def qk_head_dim(self) -> int:
        """d_qk = d_n + d_r: the head size of Q and K (Q·Kᵀ's inner dimension)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def gemms(self, hidden: int, heads: int, tp: int = 1) -> tuple[LatentGemm, ...]:
        """The attention's weight matrices in forward order as one of `tp` ranks holds them
        (its ⌈a/t⌉ heads of the split ones); at tp = 1 the whole model's."""
        local = math.ceil(heads / tp)
        query: tuple[LatentGemm, ...] = (
            LatentGemm("q_a", "replicated", hidden, self.q_lora_rank),
            LatentGemm("q_b", "column", self.q_lora_rank, local * self.qk_head_dim),
        ) if self.q_lora_rank else (
            LatentGemm("q_proj", "column", hidden, local * self.qk_head_dim),)
        return (*query,
                LatentGemm("kv_a", "replicated", hidden,
                           self.kv_lora_rank + self.qk_rope_head_dim),
                LatentGemm("kv_b", "column", self.kv_lora_rank,
                           local * (self.qk_nope_head_dim + self.v_head_dim)),
                LatentGemm("o", "row", local * self.v_head_dim, hidden))

    def norm_widths(self) -> tuple[int, ...]:
        """The widths of its two latent norms (q_a's, when it has a query latent; kv_a's),
        whole on every tp rank."""
        return (self.q_lora_rank, self.kv_lora_rank) if self.q_lora_rank \
            else (self.kv_lora_rank,)

    def split_replicated_parameters(self, hidden: int, heads: int, norm_factor: int = 1
                                    ) -> tuple[int, int]:
        """(split over t, replicated over t) parameters: the head-split matrices (q_b or
        q_proj, kv_b, o) and the whole ones (q_a, kv_a, and the latent norms of
        `norm_factor` parameters per element: 1 RMSNorm, 2 LayerNorm); no biases."""
        split = replicated = 0
        for gemm in self.gemms(hidden, heads):
            if gemm.kind == "replicated":
                replicated += gemm.inputs * gemm.outputs
            else:
                split += gemm.inputs * gemm.outputs
        return split, replicated + norm_factor * sum(self.norm_widths())

    def core_flops_per_token(self, heads: int, seq: int) -> int:
        """Forward FLOPs of the attention core per token: Q·Kᵀ, 2·s·a·d_qk, and the
        scores' product with V, 2·s·a·d_v (the s × s convention of
        `TransformerShape.block_flops_per_token`)."""
        return 2 * seq * heads * (self.qk_head_dim + self.v_head_dim)

    def flops_per_token(self, hidden: int, heads: int, seq: int) -> int:
        """Forward FLOPs of the attention per token: 2 per weight of each matrix, plus the
        core (`core_flops_per_token`)."""
        weights = sum(gemm.inputs * gemm.outputs for gemm in self.gemms(hidden, heads))
        return 2 * weights + self.core_flops_per_token(heads, seq)

    def kept_elements(self, heads: int) -> tuple[int, int]:
        """(whole on every tp rank, split over t) elements per token the attention keeps
        for its backward beyond the block's input norm and the down-projections' shared
        input (both as a dense block's, Korthikanti et al. 2022's LN input and QKV input),
        each tensor once as the fused layer keeps it:

        - whole (the latents, on every rank over all tokens as the engine's
          `split_latent_attention` runs them): each latent norm's input and q_b's / kv_b's
          input, the normalized latent: 2·r_q + 2·r_kv (2·r_kv without a query latent);
        - split by heads: the core's Q (a·d_qk, after rotary), K (a·d_qk: K_nope and the
          shared rotary key broadcast to each head, as the fused kernel takes it), V
          (a·d_v) and its output, o's input (a·d_v).

        Rotary keeps cos and sin only (not counted, as for the dense block); the scores
        (eager) or log-sum-exp (fused) are the dense block's terms, a·s and a per token."""
        whole = 2 * sum(self.norm_widths())
        return whole, heads * (2 * self.qk_head_dim + 2 * self.v_head_dim)

    def model_string(self) -> str:
        """Its model-string keys (`shape_parse.parse_shape` reads them back)."""
        return ",".join(f"{key}={getattr(self, key)}" for key in LATENT_KEYS)

    def label(self) -> str:
        query = f"q{self.q_lora_rank}" if self.q_lora_rank else "q-direct"
        return (f" mla={query}/kv{self.kv_lora_rank} "
                f"d{self.qk_nope_head_dim}+{self.qk_rope_head_dim}/v{self.v_head_dim}")


def latent_shape_problems(latent: LatentAttention, *, heads: int, kv_heads: int,
                          head_dim: int, bias: str, qk_norm: bool) -> list[str]:
    """What of a transformer shape's attention keys contradicts its latent attention: MLA
    has a key and value per query head, its own head sizes, no biases and no q/k norms."""
    problems = []
    if kv_heads not in (0, heads):
        problems.append(f"kv_heads={kv_heads} with multi-head latent attention: its keys and "
                        "values have one head per query head; omit kv_heads")
    if head_dim not in (0, latent.qk_head_dim):
        problems.append(f"head_dim={head_dim} with multi-head latent attention: its heads "
                        "are qk_nope_head_dim + qk_rope_head_dim (Q, K) and v_head_dim (V); "
                        "omit head_dim")
    if bias != "none":
        problems.append(f"bias={bias!r} with multi-head latent attention: the planner counts "
                        "it without biases (DeepSeek's attention_bias false); use bias=none")
    if qk_norm:
        problems.append("qk_norm=true with multi-head latent attention: its norms are the "
                        "latents' (counted); omit qk_norm")
    return problems
