"""A decoder-only transformer's shape, and its per-layer FLOPs, parameters and activation
bytes from the standard formulas (cited at each one)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeline.planner.errors import PlanError
from pipeline.planner.latent_attention import LatentAttention, latent_shape_problems
from pipeline.planner.moe_shape import ExpertShape
from schedules.analysis.accounting import AttentionKind, RecomputeKind, layer_activation_bytes

__all__ = ["ACTIVATION_BYTES", "TransformerShape"]

ACTIVATION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes of one activation element per precision."""


MLP_KINDS = ("gelu", "swiglu", "geglu")
NORM_KINDS = ("layernorm", "rmsnorm")
BIAS_KINDS = ("all", "qkv", "none")


@dataclass(frozen=True, kw_only=True)
class TransformerShape:
    """GPT-style decoder: embedding, `layers` blocks (attention + MLP, pre-norm), final norm
    and an output projection. Notation of Narayanan et al. 2021 / Korthikanti et al. 2022:
    l layers, h hidden, a heads, s sequence, V vocabulary, b microbatch, t tensor parallel;
    f MLP width, d head size, k = kv_heads · d the key (and value) width."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    ffn: int = 0
    """MLP inner width (0: 4 × hidden)."""
    kv_heads: int = 0
    """Key/value heads for grouped-query attention (0: = heads)."""
    head_dim: int = 0
    """Size of one attention head (0: hidden / heads; Gemma and Qwen3 give their own)."""
    mlp: str = "gelu"
    """gelu: two matrices h×f, f×h (GPT); swiglu: three, gate and up h×f, down f×h
    (Llama: down(silu(gate(x)) · up(x)), Shazeer 2020); geglu: the same shapes with GELU
    on the gate (Gemma)."""
    norm: str = "layernorm"
    """layernorm (scale and shift, 2h) or rmsnorm (scale only, h)."""
    bias: str = "all"
    """Linear biases: all (GPT), qkv (the query/key/value projection only: Qwen2), none."""
    block_norms: int = 2
    """Norms per block: 2 (pre-attention, pre-MLP), 4 with Gemma 2/3's post-norms."""
    qk_norm: bool = False
    """A norm of size d on each query and key head (Qwen3, Gemma 3)."""
    learned_positions: bool = True
    """A learned position table of positions × hidden (GPT-2/3); False for rotary ones."""
    positions: int = 0
    """Rows of the learned position table (0: seq; GPT-2's n_positions)."""
    tied_embeddings: bool = False
    """The output projection reuses the embedding (counted once in the parameter total; a
    copy where the head's stage is on another rank, `LayerProfile.tied_params_split`)."""
    moe: ExpertShape | None = None
    """A mixture of experts in the blocks `ExpertShape.is_sparse` names (their MLP); None:
    a dense model."""
    latent: LatentAttention | None = None
    """Multi-head latent attention (DeepSeek-V2 / V3, `latent_attention`) in every block
    instead of Q/K/V projections; None: standard (grouped-query) attention."""
    dropout: bool = True
    """Dropout after the embedding, attention's projection and the MLP, each keeping its
    mask for the backward (Korthikanti et al. 2022; GPT-3, Megatron's default); False for
    models trained without (Llama, this engine's blocks): no masks held."""

    def __post_init__(self) -> None:
        problems = []
        for name in ("layers", "hidden", "heads", "vocab", "seq", "block_norms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name}={value!r} must be a whole number >= 1")
        for name in ("ffn", "kv_heads", "head_dim", "positions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                problems.append(f"{name}={value!r} must be a whole number >= 0 (0: default)")
        for name, kinds in (("mlp", MLP_KINDS), ("norm", NORM_KINDS), ("bias", BIAS_KINDS)):
            if getattr(self, name) not in kinds:
                problems.append(f"{name}={getattr(self, name)!r} must be one of "
                                f"{', '.join(kinds)}")
        if self.latent is not None:
            problems += latent_shape_problems(self.latent, heads=self.heads,
                                              kv_heads=self.kv_heads, head_dim=self.head_dim,
                                              bias=self.bias, qk_norm=self.qk_norm)
        if not problems and self.latent is not None:  # Q and K's head size; V's its own
            object.__setattr__(self, "head_dim", self.latent.qk_head_dim)
        if not problems and not self.head_dim and self.hidden % self.heads:
            problems.append(f"heads={self.heads} must divide hidden={self.hidden} (or give "
                            f"head_dim)")
        if not problems and self.kv_heads and self.heads % self.kv_heads:
            problems.append(f"kv_heads={self.kv_heads} must divide heads={self.heads}")
        if self.moe is not None and self.bias == "all":
            problems.append("bias='all' with experts: no mixture-of-experts family has MLP "
                            "biases; use bias=qkv or none")
        if problems:
            raise PlanError("transformer shape: " + "; ".join(problems))
        if not self.ffn:
            object.__setattr__(self, "ffn", 4 * self.hidden)
        if not self.kv_heads:
            object.__setattr__(self, "kv_heads", self.heads)
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    @property
    def q_width(self) -> int:
        """Width of Q (and of attention's output): heads × head size."""
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of K (and of V): kv_heads × head size."""
        return self.kv_heads * self.head_dim

    @property
    def gated(self) -> bool:
        """A gated MLP (swiglu, geglu): three matrices."""
        return self.mlp != "gelu"

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of h × f in the MLP: 2 (gelu), 3 (gated)."""
        return 3 if self.gated else 2

    def norm_parameters(self) -> int:
        """Parameters of one norm over h."""
        return (2 if self.norm == "layernorm" else 1) * self.hidden

    def block_split_replicated(self) -> tuple[int, int]:
        """(split over t, replicated over t) parameters of one block, as Megatron splits it:
        the QKV and MLP-in matrices by columns with their biases, the output and MLP-out
        matrices by rows (their biases are added after the all-reduce: whole on each rank);
        norms whole on each rank."""
        h, f, q, k = self.hidden, self.ffn, self.q_width, self.kv_width
        column = h * (q + 2 * k) + (self.mlp_matrices - 1) * h * f
        row = q * h + f * h
        latent = (0, 0)
        if self.latent is not None:  # its attention's own matrices and norms (no biases)
            latent = self.latent.split_replicated_parameters(h, self.heads, 2 if self.norm
                                                             == "layernorm" else 1)
            column, row = (self.mlp_matrices - 1) * h * f + latent[0], f * h
        column_bias = (q + 2 * k) if self.bias != "none" else 0
        if self.bias == "all":
            column_bias += (self.mlp_matrices - 1) * f
        row_bias = 2 * h if self.bias == "all" else 0
        norms = self.block_norms * self.norm_parameters()
        if self.qk_norm:
            norms += (2 if self.norm == "layernorm" else 1) * 2 * self.head_dim
        return column + row + column_bias, row_bias + norms + latent[1]

    def block_parameters(self) -> int:
        """Weights and biases of one block. With ffn = 4h, GELU, LayerNorm, biases and no
        GQA this is 12h² + 13h, the per-layer term of Narayanan et al. 2021, eq. (2):
        P = 12lh²(1 + 13/12h + (V+s)/12lh)."""
        return sum(self.block_split_replicated())

    def position_parameters(self) -> int:
        """The learned position table's parameters (0 with rotary positions)."""
        return (self.positions or self.seq) * self.hidden if self.learned_positions else 0

    def is_sparse(self, index: int) -> bool:
        """Whether block `index` (from 0) has experts."""
        return self.moe is not None and self.moe.is_sparse(index)

    def moe_block_parameters(self) -> tuple[int, int, int]:
        """(split over t, replicated, experts) parameters of a MoE block: its attention and
        norms as a dense block's, its router, shared expert and gate held whole, its E
        experts (`ExpertShape.expert_parameters`, split over ep, not over t: the engine runs
        expert tensor parallelism 1, as Megatron-Core's default)."""
        assert self.moe is not None
        split, replicated = self.block_split_replicated()
        h, matrices = self.hidden, self.mlp_matrices
        return (split - matrices * h * self.ffn,
                replicated + self.moe.dense_parameters(h, matrices),
                self.moe.expert_parameters(h, matrices))

    def layer_parameters(self, index: int) -> int:
        """Parameters of block `index`, experts included."""
        return sum(self.moe_block_parameters()) if self.is_sparse(index) else \
            self.block_parameters()

    def moe_block_flops_per_token(self) -> int:
        """Forward FLOPs per token of a MoE block: a dense block whose MLP is k·f_e + f_s
        wide (each token runs its k experts and the shared one), plus the router and the
        shared expert's gate."""
        assert self.moe is not None
        return (replace(self, ffn=self.moe.active_ffn, moe=None).block_flops_per_token()
                + self.moe.router_flops_per_token(self.hidden))

    def num_parameters(self) -> int:
        h = self.hidden
        embedding = self.vocab * h + self.position_parameters()
        head = self.norm_parameters() + (0 if self.tied_embeddings else self.vocab * h)
        return embedding + sum(self.layer_parameters(i) for i in range(self.layers)) + head

    def block_flops_per_token(self) -> int:
        """Forward FLOPs of one block for one token: 2 per multiply-add of every weight
        matrix, plus the attention scores QKᵀ and their product with V, 2·s·a·d each. With
        ffn = 4h, GELU and no GQA this is 24h² + 4sh (Narayanan et al. 2021, section 5.1)."""
        h, f, q, k = self.hidden, self.ffn, self.q_width, self.kv_width
        attention = 2 * (h * (q + 2 * k) + q * h) + self.core_flops_per_token() \
            if self.latent is None else self.latent.flops_per_token(h, self.heads, self.seq)
        return attention + 2 * self.mlp_matrices * h * f

    def core_flops_per_token(self) -> int:
        """Forward FLOPs of attention's core per token (QKᵀ and its product with V: 2·s·a·d
        each; MLA's with d_qk and d_v), what selective recomputation redoes."""
        if self.latent is not None:
            return self.latent.core_flops_per_token(self.heads, self.seq)
        return 4 * self.seq * self.q_width

    def flops_per_token(self) -> int:
        """Forward FLOPs of the whole model per token: blocks and the logits 2hV. Training
        costs 3× this (backward = 2× forward), 4× with full recomputation. A MoE block
        counts its top-k and shared experts only."""
        sparse = sum(map(self.is_sparse, range(self.layers)))
        return ((self.layers - sparse) * self.block_flops_per_token()
                + (sparse and sparse * self.moe_block_flops_per_token())
                + 2 * self.hidden * self.vocab)

    def block_activation_bytes(self, element: int, *, attention: AttentionKind = "eager",
                               recompute: RecomputeKind = "none",
                               sequence_parallel: bool = False) -> tuple[float, float]:
        """(replicated, tp-split) bytes one sample's pass through a block saves for the
        backward: `schedules.analysis.accounting.layer_activation_bytes` (Korthikanti et al.
        2022, eq. (1)-(2): sbh(34 + 5as/h) for 16-bit activations, eager attention, no
        recomputation, of which sbh·10 stays whole on every tp rank), split into its part
        replicated over t and its part divided by t (from its values at t = 1 and t = 2).

        Elements of `element` bytes scale the 2-byte terms; masks stay one byte per element
        (the accounting at (element/2)× with masks of 2/element bytes). The accounting's
        block has a GELU MLP and Q as wide as h; a SwiGLU MLP keeps one more s × f tensor
        (gate and up outputs, and their product, the down projection's input: 3 where GELU
        keeps 2), and Q and attention's output are q = a·d wide (Gemma, Qwen3: not h), all
        split over t. Multi-head latent attention: Korthikanti's attention with Q, K, V h wide,
        its four split s × h tensors traded for MLA's (`LatentAttention.kept_elements`) and
        its latents added whole on every tp rank."""
        scale = element / 2
        mask = 1 / scale if self.dropout else 0.0
        extra = whole = 0.0
        kv_width = self.kv_width if self.latent is None else self.hidden
        if recompute != "full":
            wider = 2 * (self.q_width - self.hidden)  # attention's tensors beyond 4·s·h
            if self.latent is not None:
                latent_whole, latent_split = self.latent.kept_elements(self.heads)
                whole, wider = element * self.seq * latent_whole, latent_split - 4 * self.hidden
            extra = element * self.seq * ((self.ffn if self.gated else 0) + wider)

        # the fused kernel's log-sum-exp is fp32 whatever the activations (4 bytes per row
        # and head, split over t): the accounting's 16-bit terms scale, it does not
        lse = 4 * self.heads * self.seq if attention == "fused" and recompute == "none" else 0

        def at(t: int) -> float:
            return (1 - scale) * lse / t + scale * layer_activation_bytes(
                self.seq, 1, self.hidden, self.heads, attention=attention,
                recompute=recompute, t=t, sequence_parallel=sequence_parallel,
                dropout_mask_bytes=mask, ffn=self.ffn, kv_width=kv_width)

        one, two = at(1), at(2)
        return 2 * two - one + whole, 2 * (one - two) + extra
