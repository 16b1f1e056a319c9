"""Which HF mixture-of-experts families `layers_from_hf` builds, and why it refuses the rest.

Covered: decoder layers of the shape pre-norm attention + pre-norm MoE, the MoE a softmax
top-k router (``gate.weight``) over stacked experts (``experts.gate_up_proj`` /
``down_proj``), an optional sigmoid-gated shared expert, and HF's Switch load-balancing loss
(`pipeline.interop.hf_moe`); and DeepSeek-V3: HF's multi-head latent attention (split by
heads at tp > 1, `pipeline.interop.hf_tp_split.split_latent_attention`), a group-limited
sigmoid router with a correction bias, ungated shared experts and dense first layers; and
DeepSeek-V2 (the same attention and layer shape, a softmax router, greedy or
group-limited by each group's best expert, its weights scaled by ``routed_scaling_factor``,
no correction bias; `deepseek_v2_problem`). The others differ in a way those layers would
silently get wrong, so they are refused naming the difference (transformers 5.x).
"""

from __future__ import annotations

from typing import Any

__all__ = ["CHECKPOINT_BUFFERS", "COVERED_MOE", "LATENT_ATTENTION", "UNCOVERED_MOE",
           "deepseek_v2_problem", "moe_refusal"]

COVERED_MOE = {"mixtral": ("mixtral", "Mixtral"), "qwen2_moe": ("qwen2_moe", "Qwen2Moe"),
               "qwen3_moe": ("qwen3_moe", "Qwen3Moe"), "olmoe": ("olmoe", "Olmoe"),
               "deepseek_v2": ("deepseek_v2", "DeepseekV2"),
               "deepseek_v3": ("deepseek_v3", "DeepseekV3")}
"""model_type -> (``transformers.models.<module>``, class-name prefix)."""

LATENT_ATTENTION = ("deepseek_v2", "deepseek_v3")
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


DEEPSEEK_V2_TOP_K = ("greedy", "group_limited_greedy")
"""The ``topk_method`` values transformers' DeepSeek-V2 router implements."""


def deepseek_v2_problem(config: Any) -> str | None:
    """Why a DeepSeek-V2 config would not route as transformers' ``DeepseekV2TopkRouter``
    (None: it would)."""
    method = getattr(config, "topk_method", None)
    if method not in DEEPSEEK_V2_TOP_K:
        return (f"topk_method={method!r} is not one transformers' DeepSeek-V2 router runs; use "
                f"one of {list(DEEPSEEK_V2_TOP_K)}")
    if getattr(config, "norm_topk_prob", False):
        return ("norm_topk_prob=True: transformers' DeepSeek-V2 router ignores it (DeepSeek's "
                "own code divides the top-k weights by their sum), so the two disagree; set "
                "it to False to train as transformers does")
    if method == "group_limited_greedy" and not all(
            isinstance(getattr(config, name, None), int) for name in ("n_group", "topk_group")):
        return (f"topk_method='group_limited_greedy' needs integer n_group and topk_group, got "
                f"n_group={config.n_group!r}, topk_group={config.topk_group!r}")
    if not getattr(config, "n_shared_experts", None):
        return (f"n_shared_experts={config.n_shared_experts!r}: transformers' DeepSeek-V2 "
                "builds its shared experts from it; set it to 1 or more")
    return None


def moe_refusal(model_type: str, experts: int) -> str:
    """The one-line refusal of an uncovered MoE family."""
    reason = UNCOVERED_MOE.get(model_type, "its router, expert layout and load-balancing "
                                           "loss are not mapped")
    return (f"layers_from_hf covers the mixture-of-experts model types "
            f"{', '.join(COVERED_MOE)}, not {model_type!r} ({experts} experts): {reason}")
