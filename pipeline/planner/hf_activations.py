"""The activations of a Hugging Face model's blocks as this engine runs them: HF's eager
modules, priced per saved tensor (`schedules.analysis.eager_activations`), not Korthikanti
et al.'s fused Megatron layer (`TransformerShape.block_activation_bytes`), which under-prices
them by 62-74 % (benchmarks/bench_hf_tp_memory.py)."""

from __future__ import annotations

from dataclasses import replace

from pipeline.planner.profile import LayerProfile, ModelProfile
from pipeline.planner.transformer import TransformerShape
from schedules.analysis.eager_activations import eager_core_bytes, eager_layer_activation_bytes

__all__ = ["EAGER_FAMILIES", "UNCOVERED", "eager_block_bytes", "eager_head_bytes",
           "hf_eager_profile"]

EAGER_FAMILIES = {"llama": 4, "mistral": 4, "qwen2": 4, "gpt2": 5}
"""Families whose block `eager_layer_activation_bytes` prices, checked against the bytes
autograd saves for a tiny model of each (tests/planner/test_hf_eager_plan.py): model_type:
the s·f/t tensors its MLP keeps (SwiGLU 4, GPT-2's python gelu_new 5)."""

UNCOVERED = {
    "qwen3": "its q/k norms keep tensors the model does not count",
    "phi3": "its fused qkv and gate_up projections keep other tensors",
    "gemma2": "its four norms per block and soft-capped eager attention",
    "gemma3_text": "its four norms per block and q/k norms",
    "mixtral": "its routed experts", "qwen2_moe": "its routed experts",
    "qwen3_moe": "its routed experts",
    "deepseek_v2": "its routed experts and multi-head latent attention",
    "deepseek_v3": "its routed experts and multi-head latent attention",
}
"""The other families `hf_config.FAMILIES` reads, and why their blocks keep Korthikanti's
pricing (a tiny model of each saves more than `eager_layer_activation_bytes` counts)."""


def eager_block_bytes(shape: TransformerShape, family: str, *,
                      sequence_parallel: bool) -> tuple[float, float, float]:
    """(replicated, tp-split, tp-split under selective recomputation) bytes one sample keeps
    of a block of `family`: `eager_layer_activation_bytes` is R + S/t in the tp size t, so
    its values at t = 1 and t = 2 give R and S; selective drops `eager_core_bytes`."""

    def at(t: int) -> float:
        return eager_layer_activation_bytes(
            shape.seq, 1, shape.hidden, shape.heads, q_width=shape.q_width,
            kv_width=shape.kv_width, ffn=shape.ffn, head_dim=shape.head_dim,
            norm="layernorm" if shape.norm == "layernorm" else "rmsnorm",
            rotary=not shape.learned_positions, mlp_tensors=EAGER_FAMILIES[family], t=t,
            sequence_parallel=sequence_parallel)

    one, two = at(1), at(2)
    split = 2 * (one - two)
    return 2 * two - one, split, split - eager_core_bytes(shape.seq, 1, shape.heads)


def eager_head_bytes(shape: TransformerShape, *, sequence_parallel: bool
                     ) -> tuple[float, float]:
    """(replicated, tp-split) bytes one sample keeps of the head of a HF model as this
    engine runs it, the fp32 logits the loss saves aside (`loss_held_split`, unchanged):
    the final norm's tensors (RMSNorm: its input, the normalized tensor and rsqrt,
    2·s·h + s; LayerNorm: its input, mean and rstd, s·h + 2·s), the output projection's
    input (s·h; Korthikanti's head counts one s·h for the norm and one for the projection)
    and the loss's int64 targets (8·s bytes). Under sequence parallelism the norm's tensors
    and the projection's input are this rank's slice (split); else replicated."""
    s, h = shape.seq, shape.hidden
    norm = 2 * s * h + s if shape.norm != "layernorm" else s * h + 2 * s
    tensors = 4.0 * (norm + s * h)
    targets = 8.0 * s
    return (targets, tensors) if sequence_parallel else (targets + tensors, 0.0)


def hf_eager_profile(profile: ModelProfile, shape: TransformerShape, family: str, *,
                     sequence_parallel: bool, sliding_window: int | None = None
                     ) -> ModelProfile:
    """`profile` (`transformer_profile` of a HF config's `shape`) with its blocks' and head's
    activations as this engine's HF layers keep them (`eager_block_bytes`,
    `eager_head_bytes`); a fully recomputed block keeps
    its input hidden state in fp32 (the residual stream stays fp32 under autocast, the
    weights being fp32). A family in `UNCOVERED` keeps Korthikanti's pricing, its label
    saying so and why, as does a `sliding_window` not longer than the sequence (Mistral's,
    or Qwen2's with use_sliding_window): its mask sends SDPA down a kernel that saves more
    (a tiny Mistral counted: so at a window equal to the sequence too).

    Every precision is priced as fp32, which the model is checked in. Under bf16/fp16
    autocast what a block saves depends on the path (benchmarks/bench_hf_autocast_activations.py,
    tp 2, tiny Llama / GPT-2 against this fp32 pricing: 1.11 / 0.86 without sequence
    parallelism, where autocast's matmuls save bf16 copies of the weights once per
    microbatch; 0.71 / 0.93 with it, where the column regions keep fp32 inputs beside half
    tensors): not modelled per dtype (docs/planner.md)."""
    windowed = sliding_window is not None and sliding_window <= shape.seq
    if family not in EAGER_FAMILIES or shape.dropout or windowed:
        why = (UNCOVERED.get(family, "not a family the eager model was checked on")
               if family not in EAGER_FAMILIES else
               "its dropout (above 0 in the config) keeps masks the model does not count"
               if shape.dropout else
               f"its sliding window of {sliding_window} tokens, not longer than the "
               f"sequence's {shape.seq}, sends SDPA down another kernel (saves more)")
        return replace(profile, name=f"{profile.name} [activations: Korthikanti's fused "
                                     f"layer, not {family}'s eager HF blocks: {why}]")
    replicated, split, selective = eager_block_bytes(shape, family,
                                                     sequence_parallel=sequence_parallel)
    head_replicated, head_split = eager_head_bytes(shape, sequence_parallel=sequence_parallel)

    def eager(layer: LayerProfile) -> LayerProfile:
        if layer.name.startswith("block"):
            return replace(layer, held_split=split, held_replicated=replicated,
                           selective_held_split=selective,
                           input_bytes=4 * shape.seq * shape.hidden)
        if layer.name == "head":
            return replace(layer, held_split=layer.loss_held_split + head_split,
                           held_replicated=head_replicated)
        return layer

    layers = tuple(eager(layer) for layer in profile.layers)
    return replace(profile, layers=layers,
                   name=f"{profile.name} [activations: eager HF {family} blocks]")
