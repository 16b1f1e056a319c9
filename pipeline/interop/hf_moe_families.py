"""Which HF mixture-of-experts families `layers_from_hf` builds, and why it refuses the rest.

Covered: decoder layers of the shape pre-norm attention + pre-norm MoE, the MoE a softmax
top-k router (``gate.weight``) over stacked experts (``experts.gate_up_proj`` /
``down_proj``), an optional sigmoid-gated shared expert, and HF's Switch load-balancing loss
(`pipeline.interop.hf_moe`); and DeepSeek-V3: HF's multi-head latent attention (split by
heads at tp > 1, `pipeline.interop.hf_tp_split.split_latent_attention`), a group-limited
sigmoid router with a correction bias, ungated shared experts and dense first layers. The
others differ in a way those layers would silently get wrong, so they are refused naming the
difference (transformers 5.x).
"""

from __future__ import annotations

__all__ = ["CHECKPOINT_BUFFERS", "COVERED_MOE", "LATENT_ATTENTION", "UNCOVERED_MOE",
           "moe_refusal"]

COVERED_MOE = {"mixtral": ("mixtral", "Mixtral"), "qwen2_moe": ("qwen2_moe", "Qwen2Moe"),
               "qwen3_moe": ("qwen3_moe", "Qwen3Moe"), "olmoe": ("olmoe", "Olmoe"),
               "deepseek_v3": ("deepseek_v3", "DeepseekV3")}
"""model_type -> (``transformers.models.<module>``, class-name prefix)."""

LATENT_ATTENTION = ("deepseek_v3",)
"""Covered families whose attention is multi-head latent attention (HF's own module, split by
heads at tp > 1)."""

CHECKPOINT_BUFFERS = ("e_score_correction_bias",)
"""Buffer names HF's checkpoints hold (loaded and exported with the parameters)."""

UNCOVERED_MOE = {
    "phimoe": "its router is SparseMixer (a two-pass masked top-2 with jitter), not a "
              "softmax top-k, and its norms are LayerNorms with biases",
    "granitemoe": "its blocks scale embeddings, attention, residuals and logits by config "
                  "multipliers the shared MoE block does not apply",
    "granitemoeshared": "its blocks scale embeddings, attention, residuals and logits by "
                        "config multipliers the shared MoE block does not apply",
    "granitemoehybrid": "it mixes Mamba-2 layers with attention, and scales by multipliers",
    "qwen3_next": "it mixes Gated-DeltaNet linear-attention layers with gated attention",
    "deepseek_v2": "its attention is multi-head latent attention and its router is "
                   "group-limited with a routed scaling factor",
    "flex_olmo": "its norms come after attention and the MoE (post-norm), not before",
    "dbrx": "its experts and router are laid out differently (fused ffn, normalised "
            "by a p-norm) and its attention is fused Wqkv with clipping",
    "jetmoe": "it routes attention heads too (mixture of attention heads)",
    "llama4": "its router scores by sigmoid of the top-k logits, scales the experts' "
              "input, and mixes chunked attention layers",
    "gpt_oss": "its experts have biases, a clamped SwiGLU and attention sinks",
    "jamba": "it mixes Mamba layers with attention",
    "glm4_moe": "its router scores by sigmoid with a correction bias over expert groups",
    "minimax": "it mixes lightning (linear) attention layers with softmax attention",
}
"""model_type -> what about it the covered layers would get wrong."""


def moe_refusal(model_type: str, experts: int) -> str:
    """The one-line refusal of an uncovered MoE family."""
    reason = UNCOVERED_MOE.get(model_type, "its router, expert layout and load-balancing "
                                           "loss are not mapped")
    return (f"layers_from_hf covers the mixture-of-experts model types "
            f"{', '.join(COVERED_MOE)}, not {model_type!r} ({experts} experts): {reason}")
