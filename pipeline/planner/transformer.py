"""A decoder-only transformer's shape, and its per-layer FLOPs, parameters and activation
bytes from the standard formulas (cited at each one)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from pipeline.planner.errors import PlanError
from pipeline.planner.input_files import read_input_json
from pipeline.planner.kernels import LayerShape
from pipeline.planner.profile import LayerProfile, ModelProfile
from schedules.analysis.accounting import AttentionKind, RecomputeKind, layer_activation_bytes

__all__ = ["TransformerShape", "parse_shape", "transformer_profile"]

ACTIVATION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes of one activation element per precision."""


@dataclass(frozen=True, kw_only=True)
class TransformerShape:
    """GPT-style decoder: embedding, `layers` blocks (attention + MLP, pre-norm), final norm
    and an output projection. Notation of Narayanan et al. 2021 / Korthikanti et al. 2022:
    l layers, h hidden, a heads, s sequence, V vocabulary, b microbatch, t tensor parallel."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    ffn: int = 0
    """MLP inner width (0: 4 × hidden)."""
    kv_heads: int = 0
    """Key/value heads for grouped-query attention (0: = heads)."""
    learned_positions: bool = True
    """A learned position table of seq × hidden (GPT-2/3); False for rotary embeddings."""
    tied_embeddings: bool = False
    """The output projection reuses the embedding (counted once in the parameter total; a
    copy where the head's stage is on another rank, `LayerProfile.tied_params_split`)."""

    def __post_init__(self) -> None:
        problems = []
        for name in ("layers", "hidden", "heads", "vocab", "seq"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name}={value!r} must be a whole number >= 1")
        for name in ("ffn", "kv_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                problems.append(f"{name}={value!r} must be a whole number >= 0 (0: default)")
        if not problems and self.hidden % self.heads:
            problems.append(f"heads={self.heads} must divide hidden={self.hidden}")
        if not problems and self.kv_heads and self.heads % self.kv_heads:
            problems.append(f"kv_heads={self.kv_heads} must divide heads={self.heads}")
        if problems:
            raise PlanError("transformer shape: " + "; ".join(problems))
        if not self.ffn:
            object.__setattr__(self, "ffn", 4 * self.hidden)
        if not self.kv_heads:
            object.__setattr__(self, "kv_heads", self.heads)

    @property
    def kv_width(self) -> int:
        """Width of K (and of V): kv_heads × head size."""
        return self.kv_heads * (self.hidden // self.heads)

    def block_parameters(self) -> int:
        """Weights and biases of one block. With ffn = 4h and no GQA this is 12h² + 13h, the
        per-layer term of Narayanan et al. 2021, eq. (2): P = 12lh²(1 + 13/12h + (V+s)/12lh)."""
        h, f, k = self.hidden, self.ffn, self.kv_width
        attention = h * (h + 2 * k) + (h + 2 * k) + h * h + h  # QKV and output projections
        mlp = h * f + f + f * h + h
        norms = 2 * 2 * h  # two LayerNorms, scale and shift
        return attention + mlp + norms

    def num_parameters(self) -> int:
        h = self.hidden
        embedding = self.vocab * h + (self.seq * h if self.learned_positions else 0)
        head = 2 * h + (0 if self.tied_embeddings else self.vocab * h)
        return embedding + self.layers * self.block_parameters() + head

    def block_flops_per_token(self) -> int:
        """Forward FLOPs of one block for one token: 2 per multiply-add of every weight
        matrix, plus the attention scores QKᵀ and their product with V, 2·s·h each. With
        ffn = 4h this is 24h² + 4sh (Narayanan et al. 2021, section 5.1)."""
        h, f, k = self.hidden, self.ffn, self.kv_width
        return 2 * (h * (h + 2 * k) + h * h + 2 * h * f) + 4 * self.seq * h

    def flops_per_token(self) -> int:
        """Forward FLOPs of the whole model per token: blocks and the logits 2hV. Training
        costs 3× this (backward = 2× forward), 4× with full recomputation."""
        return self.layers * self.block_flops_per_token() + 2 * self.hidden * self.vocab

    def block_activation_bytes(self, element: int, *, attention: AttentionKind = "eager",
                               recompute: RecomputeKind = "none",
                               sequence_parallel: bool = False) -> tuple[float, float]:
        """(replicated, tp-split) bytes one sample's pass through a block saves for the
        backward: `schedules.analysis.accounting.layer_activation_bytes` (Korthikanti et al.
        2022, eq. (1)-(2): sbh(34 + 5as/h) for 16-bit activations, eager attention, no
        recomputation, of which sbh·10 stays whole on every tp rank), split into its part
        replicated over t and its part divided by t (from its values at t = 1 and t = 2).

        Elements of `element` bytes scale the 2-byte terms; masks stay one byte per element
        (the accounting at (element/2)× with masks of 2/element bytes)."""
        scale = element / 2

        def at(t: int) -> float:
            return scale * layer_activation_bytes(
                self.seq, 1, self.hidden, self.heads, attention=attention,
                recompute=recompute, t=t, sequence_parallel=sequence_parallel,
                dropout_mask_bytes=1 / scale, ffn=self.ffn, kv_width=self.kv_width)

        one, two = at(1), at(2)
        return 2 * two - one, 2 * (one - two)


def transformer_profile(shape: TransformerShape, precision: str = "bf16", *,
                        attention: str = "fused", sequence_parallel: bool = False,
                        tp_comm_overlap: bool = False) -> ModelProfile:
    """Embedding, the blocks and the head as pipeline layers, each priced per sample.

    `attention` "fused" (FlashAttention: the s × s scores are never stored, the backward
    recomputes them) or "eager" (scores, softmax and its dropout mask saved: Korthikanti's
    5as²). `sequence_parallel` splits the norms', dropouts' and residuals' activations over
    t too (Korthikanti et al. 2022, section 4.2.2: sbh(34 + 5as/h)/t). `tp_comm_overlap`
    prices the blocks' tp collectives beside their GEMMs, as the engine's overlapped layers
    run them (`pricing.layer_tp_pass_seconds`)."""
    if precision not in ACTIVATION_BYTES:
        raise PlanError(f"precision {precision!r} is not one of {sorted(ACTIVATION_BYTES)}")
    if attention not in ("fused", "eager"):
        raise PlanError(f"attention {attention!r} must be 'fused' or 'eager'")
    element = ACTIVATION_BYTES[precision]
    s, h, vocab = shape.seq, shape.hidden, shape.vocab
    hidden_bytes = s * h * element
    kind: AttentionKind = "fused" if attention == "fused" else "eager"
    replicated, split = shape.block_activation_bytes(element, attention=kind,
                                                     sequence_parallel=sequence_parallel)
    selective = sum(shape.block_activation_bytes(element, recompute="selective",
                                                 sequence_parallel=sequence_parallel))

    def kernels(role: Literal["embedding", "block", "head"]) -> LayerShape:
        return LayerShape(role, s, h, shape.heads, shape.kv_width, shape.ffn, vocab, element,
                          "fused" if attention == "fused" else "eager", sequence_parallel,
                          tp_comm_overlap)

    embedding = LayerProfile(
        name="embedding", params_split=vocab * h,  # vocab-parallel (Megatron)
        params_replicated=s * h if shape.learned_positions else 0,
        output_bytes=hidden_bytes, tp_allreduces=1, tp_allreduce_bytes=hidden_bytes,
        shape=kernels("embedding"))
    block_weights = shape.block_parameters() - 4 * h  # all but the norms split over t
    block = kernels("block")
    blocks = [LayerProfile(
        name=f"block{index}", flops_split=s * shape.block_flops_per_token(),
        params_split=block_weights, params_replicated=4 * h,
        held_split=split, held_replicated=replicated, output_bytes=hidden_bytes,
        input_bytes=hidden_bytes, input_split=sequence_parallel,
        selective_held_split=selective - replicated,
        selective_flops_split=4 * s * s * h, tp_allreduces=2, tp_allreduce_bytes=hidden_bytes,
        shape=block)
        for index in range(shape.layers)]
    # Output layer: final norm input (sh) and fp32 logits for the cross entropy, 4sV/t bytes
    # (Korthikanti et al. 2022, section 4.1, "output layer"); its input's gradient is
    # all-reduced over tp in the backward (a column-parallel layer), priced as one pass.
    head = LayerProfile(
        name="head", flops_split=2 * s * h * vocab,
        params_split=0 if shape.tied_embeddings else vocab * h, params_replicated=2 * h,
        tied_params_split=vocab * h if shape.tied_embeddings else 0,
        held_split=4 * s * vocab, held_replicated=hidden_bytes, input_bytes=hidden_bytes,
        output_bytes=4 * s, shape=kernels("head"))
    return ModelProfile((embedding, *blocks, head), name=_label(shape), heads=shape.heads,
                        seq=s)


def _label(shape: TransformerShape) -> str:
    return (f"transformer l={shape.layers} h={shape.hidden} a={shape.heads} f={shape.ffn} "
            f"V={shape.vocab} s={shape.seq}")


_INT_KEYS = {f.name for f in fields(TransformerShape)} - {"learned_positions", "tied_embeddings"}
_BOOL_KEYS = {"learned_positions", "tied_embeddings"}


def parse_shape(source: str | Mapping[str, Any], *, seq: int | None = None) -> TransformerShape:
    """`layers=32,hidden=4096,heads=32,vocab=32000,seq=2048[,ffn=..,kv_heads=..]`, a JSON
    file with those keys, or a mapping; `seq` overrides the sequence length."""
    if isinstance(source, Mapping):
        values = dict(source)
    elif source.endswith(".json") or os.path.exists(source):

        values = read_input_json(source, "model file")
        if not isinstance(values, dict):
            raise PlanError(f"model file {source!r} must hold a JSON object")
    else:
        values = {}
        for item in filter(None, source.split(",")):
            key, sep, text = item.partition("=")
            if not sep:
                raise PlanError(f"model shape item {item!r} is not key=value; e.g. "
                                f"layers=24,hidden=2048,heads=16,vocab=50257,seq=2048")
            key = key.strip()
            if key in values:
                raise PlanError(f"model shape gives {key}= twice ({source[:120]!r}); give "
                                "each key once")
            if key in _BOOL_KEYS:
                values[key] = text.strip().lower() in ("1", "true", "yes")
                continue
            try:
                values[key] = int(text)
            except ValueError:
                raise PlanError(f"model shape {key}={text!r} must be a whole number") from None
    if seq is not None:
        values["seq"] = seq
    explicit_zero = [key for key in ("ffn", "kv_heads") if values.get(key) == 0]
    if explicit_zero:  # 0 is the dataclass's "use the default", not a size anyone means
        raise PlanError(f"model shape {', '.join(f'{key}=0' for key in explicit_zero)}: "
                        "must be >= 1; omit the key for the default (ffn 4 × hidden, "
                        "kv_heads = heads)")
    unknown = sorted(set(values) - _INT_KEYS - _BOOL_KEYS)
    if unknown:
        raise PlanError(f"model shape has unknown keys {unknown}; the keys are "
                        f"{sorted(_INT_KEYS | _BOOL_KEYS)}")
    missing = sorted({"layers", "hidden", "heads", "vocab", "seq"} - set(values))
    if missing:
        raise PlanError(f"model shape lacks {missing} (give seq with --seq)")
    return TransformerShape(**values)
