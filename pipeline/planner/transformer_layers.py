"""A transformer's pipeline layers: its embedding, blocks (dense, MoE) and head as the
planner prices them (`LayerProfile`s), from a `TransformerShape`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Literal

from pipeline.planner.errors import PlanError
from pipeline.planner.kernels import LayerShape
from pipeline.planner.moe_shape import RoutedExperts
from pipeline.planner.profile import LayerProfile, ModelProfile
from pipeline.planner.transformer import ACTIVATION_BYTES, TransformerShape
from schedules.analysis.accounting import AttentionKind

__all__ = ["transformer_profile"]


def transformer_profile(shape: TransformerShape, precision: str = "bf16", *,
                        attention: str = "fused", sequence_parallel: bool = False,
                        engine: str = "pipesched") -> ModelProfile:
    """Embedding, the blocks and the head as pipeline layers, each priced per sample.

    `attention` "fused" (FlashAttention: the s × s scores are never stored, the backward
    recomputes them) or "eager" (scores, softmax and its dropout mask saved: Korthikanti's
    5as²). `sequence_parallel` splits the norms', dropouts' and residuals' activations over
    t too (Korthikanti et al. 2022, section 4.2.2: sbh(34 + 5as/h)/t). `engine`: whose
    code runs the model, this engine's ("pipesched") or Megatron-LM's of 2021
    ("megatron-2021": its element-wise kernels, `kernels.LayerShape.engine`, and its
    `--checkpoint-activations`, which recomputes the blocks only:
    `ParallelTransformer._checkpointed_forward` over its layers, the embedding, final norm,
    logits and loss outside it, commit f32a638d2d)."""
    if precision not in ACTIVATION_BYTES:
        raise PlanError(f"precision {precision!r} is not one of {sorted(ACTIVATION_BYTES)}")
    if attention not in ("fused", "eager"):
        raise PlanError(f"attention {attention!r} must be 'fused' or 'eager'")
    if engine not in ("pipesched", "megatron-2021"):
        raise PlanError(f"engine {engine!r} must be 'pipesched' or 'megatron-2021'")
    if engine == "megatron-2021" and shape.latent is not None:
        raise PlanError("engine 'megatron-2021' (Megatron-LM of 2021) has no multi-head latent "
                        "attention; plan this model for pipesched or megatron-core")
    code: Literal["pipesched", "megatron-2021"] = \
        "megatron-2021" if engine == "megatron-2021" else "pipesched"
    blocks_only = engine == "megatron-2021"  # what its full recomputation leaves out
    element = ACTIVATION_BYTES[precision]
    s, h, vocab = shape.seq, shape.hidden, shape.vocab
    hidden_bytes = s * h * element
    kind: AttentionKind = "fused" if attention == "fused" else "eager"

    def kernels(role: Literal["embedding", "block", "head"], ffn: int = shape.ffn
                ) -> LayerShape:
        return LayerShape(role, s, h, shape.heads, shape.kv_width, ffn, vocab, element,
                          "fused" if attention == "fused" else "eager", sequence_parallel,
                          head_dim=shape.head_dim, gated=shape.gated, engine=code,
                          latent=shape.latent)

    def block(of: TransformerShape) -> LayerProfile:
        """A block of shape `of`, dense (a MoE block is one whose MLP is k·f_e + f_s wide,
        `_moe_block`)."""
        replicated, split = of.block_activation_bytes(element, attention=kind,
                                                      sequence_parallel=sequence_parallel)
        selective = sum(of.block_activation_bytes(element, recompute="selective",
                                                  sequence_parallel=sequence_parallel))
        block_split, block_replicated = of.block_split_replicated()
        return LayerProfile(
            name="block", flops_split=s * of.block_flops_per_token(),
            params_split=block_split, params_replicated=block_replicated,
            held_split=split, held_replicated=replicated, output_bytes=hidden_bytes,
            input_bytes=hidden_bytes, input_split=sequence_parallel,
            selective_held_split=selective - replicated,
            selective_flops_split=s * of.core_flops_per_token(), tp_allreduces=2,
            tp_allreduce_bytes=hidden_bytes, shape=kernels("block", of.ffn))

    # Input embedding: its dropout's 1-byte mask, sh (Korthikanti et al. 2022, section 4.3:
    # "sbhp/t" over the p microbatches 1F1B's first stage holds, split with sequence
    # parallelism); a vocab-parallel table (Megatron)
    mask = s * h if shape.dropout else 0.0
    embedding = LayerProfile(
        name="embedding", params_split=vocab * h,
        params_replicated=shape.position_parameters(),
        held_split=mask if sequence_parallel else 0.0,
        held_replicated=0.0 if sequence_parallel else mask,
        output_bytes=hidden_bytes, tp_allreduces=1, tp_allreduce_bytes=hidden_bytes,
        shape=kernels("embedding"), checkpointed=not blocks_only)
    dense = block(shape)
    sparse = _moe_block(shape, block, element) if shape.moe is not None else dense
    blocks = [replace(sparse if shape.is_sparse(index) else dense, name=f"block{index}")
              for index in range(shape.layers)]
    # Output layer: the final norm's input and the projection's (2sh each) and the fp32
    # logits for the cross entropy, 4sV/t: Korthikanti et al. 2022, section 4.3, "4sbh/t ·
    # (1 + v/h)" with sequence parallelism, the norm's and projection's inputs whole on
    # every tp rank without it. Its input's gradient is all-reduced over tp in the backward
    # (a column-parallel layer), priced as one pass.
    norm_and_projection = 2 * hidden_bytes
    head = LayerProfile(
        name="head", flops_split=2 * s * h * vocab,
        params_split=0 if shape.tied_embeddings else vocab * h,
        params_replicated=shape.norm_parameters(),
        tied_params_split=vocab * h if shape.tied_embeddings else 0,
        held_split=4 * s * vocab + (norm_and_projection if sequence_parallel else 0.0),
        loss_held_split=4 * s * vocab,
        held_replicated=0.0 if sequence_parallel else norm_and_projection,
        input_bytes=hidden_bytes, input_split=sequence_parallel,
        output_bytes=4 * s, shape=kernels("head"), checkpointed=not blocks_only)
    divides = (("attention heads", shape.heads), ("key/value heads", shape.kv_heads),
               ("MLP columns", shape.ffn))
    return ModelProfile((embedding, *blocks, head), name=_label(shape), heads=shape.heads,
                        seq=s, tp_divides=divides,
                        experts=shape.moe.experts if shape.moe is not None else 0,
                        routing=shape.moe.routing if shape.moe is not None else None)


def _moe_block(shape: TransformerShape, block: Callable[[TransformerShape], LayerProfile],
               element: int) -> LayerProfile:
    """A MoE block as the dense `block` of a k·f_e + f_s wide MLP (its FLOPs, kernels and
    kept activations: each token's k expert and shared MLP passes, whose inputs and
    intermediates the backward needs), with its own parameters (router, shared expert and
    gate with the rest, the E experts apart: split over ep) and its all-to-all: each token's
    hidden state sent to its k experts, s·k·h elements per sample each way
    (`expert_parallel.expert_all_to_all`). The router's logits and the dispatch's index
    bookkeeping are not counted in the activations (E and k words per token against
    k·(3f_e) of the experts' own). Its kernels: the dense block's attention, norms and
    residuals, and its MLP as the engines run it (`kernels.LayerShape.routed`,
    `expert_kernels`: router, permutations, one GEMM per local expert on the busiest ep
    rank's rows; ep 1 here, the search's configuration sets it, `RankPricing.layers_at`).
    At t > 1 its MLP runs unsplit on the rank's s/t tokens: attention's collectives only,
    one all-reduce's bytes a pass, none around the MLP (its all-to-all takes and returns
    the rank's slice)."""
    assert shape.moe is not None
    active = replace(shape, ffn=shape.moe.active_ffn, moe=None)
    split, replicated, experts = shape.moe_block_parameters()
    dense = block(active)
    assert dense.shape is not None
    routed = RoutedExperts(experts=shape.moe.experts, topk=shape.moe.topk,
                           expert_ffn=shape.moe.expert_ffn, shared_ffn=shape.moe.shared_ffn)
    return replace(dense, flops_split=shape.seq * shape.moe_block_flops_per_token(),
                   params_split=split, params_replicated=replicated, expert_params=experts,
                   all_to_all_bytes=shape.seq * shape.moe.topk * shape.hidden * element,
                   tp_allreduces=1, shape=replace(dense.shape, routed=routed))


def _label(shape: TransformerShape) -> str:
    grouped = f" kv={shape.kv_heads}" if shape.kv_heads != shape.heads else ""
    return (f"transformer l={shape.layers} h={shape.hidden} a={shape.heads}{grouped} "
            f"f={shape.ffn}{'' if shape.mlp == 'gelu' else ' ' + shape.mlp} V={shape.vocab} "
            f"s={shape.seq}{' tied' if shape.tied_embeddings else ''}"
            f"{shape.latent.label() if shape.latent is not None else ''}"
            f"{shape.moe.label() if shape.moe is not None else ''}")
