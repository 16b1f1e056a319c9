"""The device model: a transformer layer's kernels priced from their shapes. GEMMs by a
roofline with tile and wave quantization, element-wise work by bytes over HBM bandwidth,
attention eager (s × s scores in memory) or fused (FlashAttention: none), every kernel
paying a fixed launch cost.

Notation (Narayanan et al. 2021; Korthikanti et al. 2022): b microbatch, s sequence, h
hidden, a heads, k key/value width, f MLP width, V vocabulary, t tensor parallel, e bytes of
an activation element, T = b·s tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.latent_attention import LatentAttention
from pipeline.planner.moe_shape import RoutedExperts
from pipeline.planner.roofline import (
    TILE_ROW_GRANULE,
    _stream_seconds,
    elementwise_seconds,
    epilogue_seconds,
    gemm_seconds,
)

__all__ = ["TILE_ROW_GRANULE", "KernelTimes", "LayerShape", "attention_core_seconds",
           "block_linear_times", "elementwise_seconds", "epilogue_seconds", "gemm_seconds",
           "layer_kernel_times"]

_FUSED_ATTENTION = 0.75
"""FlashAttention reaches ~3/4 of a plain GEMM's throughput (Dao 2023, FlashAttention-2)."""


@dataclass(frozen=True)
class LayerShape:
    """What the kernel model needs of one pipeline layer of a transformer."""

    role: Literal["embedding", "block", "head"]
    seq: int
    hidden: int
    heads: int
    kv_width: int
    ffn: int
    vocab: int
    element: int
    """Bytes of one activation element."""
    attention: Literal["fused", "eager"] = "fused"
    sequence_parallel: bool = False
    """Norms, dropout and residuals run on s/t tokens per tp rank (Korthikanti et al. 2022)."""
    head_dim: int = 0
    """Size of one attention head (0: hidden / heads)."""
    gated: bool = False
    """A SwiGLU MLP: gate and up (h → 2f, one column-parallel GEMM), silu(gate)·up, down."""
    tp_overlap_chunks: int = 2
    """Slices an overlapped block (`pricing.TP_OVERLAPS` "pipesched") pipelines its
    collectives in, the engine's `chunks` default."""
    routed: RoutedExperts | None = None
    """The block's MLP is a MoE's (experts unsplit over tp, expert tensor parallelism 1, no
    tensor-parallel collective around it): priced apart, per local expert on the busiest
    ep rank's rows (`expert_kernels.moe_mlp_times`); this module prices the block's
    attention, norms and residuals only."""
    engine: Literal["pipesched", "megatron-2021"] = "pipesched"
    """Whose code runs the layer: "megatron-2021" adds the element-wise passes Megatron-LM's
    code of 2021 runs besides this engine's (`_megatron_2021_block`,
    `_megatron_2021_cross_entropy`)."""
    latent: LatentAttention | None = None
    """Multi-head latent attention: its GEMMs (`LatentAttention.gemms`), latent norms and a
    core of two head sizes, Q·Kᵀ over d_qk and P·V over d_v."""

    @property
    def experts(self) -> bool:
        """Whether the block's MLP is a MoE's (`routed`)."""
        return self.routed is not None

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def value_size(self) -> int:
        """Size of one value head: MLA's d_v, else the head size."""
        return self.latent.v_head_dim if self.latent is not None else self.head_size


@dataclass(frozen=True)
class KernelTimes:
    """Seconds of one microbatch through a layer on one tp rank, compute only (the tensor-
    parallel collectives are the network model's): forward, and the backward's two halves,
    the input gradient (I: data gradients, element-wise and attention backward) and the
    weight gradient (W: the weight GEMMs)."""

    forward: float
    input_grad: float
    weight_grad: float



def _linear(tokens: int, inputs: int, outputs: int, cluster: ClusterSpec, precision: str,
            element: int) -> tuple[float, float, float]:
    """(forward, input gradient, weight gradient) seconds of Y = X·W, X tokens × inputs."""
    def gemm(m: int, n: int, k: int) -> float:
        return gemm_seconds(m, n, k, cluster, precision, element=element)

    return (gemm(tokens, outputs, inputs), gemm(tokens, inputs, outputs),
            gemm(inputs, outputs, tokens))


def layer_kernel_times(shape: LayerShape, batch: int, tp: int, cluster: ClusterSpec,
                       precision: str) -> KernelTimes:
    """One microbatch of `batch` samples through `shape` on one of `tp` ranks."""
    e, s, h = shape.element, shape.seq, shape.hidden
    tokens = batch * s
    # tokens the replicated element-wise kernels (norms, dropout, residual) run on
    local = math.ceil(tokens / tp) if shape.sequence_parallel else tokens
    parts = [(0.0, 0.0, 0.0)]
    if shape.role == "embedding":
        # gather rows of the table (+ positions): write T·h, read as much; backward scatters
        parts.append((_stream_seconds(3 * tokens * h * e, cluster, 2),
                      0.0, _stream_seconds(3 * tokens * h * e, cluster, 2)))
    elif shape.role == "head":
        width = math.ceil(shape.vocab / tp)
        norm = _stream_seconds(2 * local * h * e, cluster)
        parts.append((norm, 1.5 * norm, 0.0))
        parts.append(_linear(tokens, h, width, cluster, precision, e))
        if shape.engine == "megatron-2021":
            parts.append(_megatron_2021_cross_entropy(tokens * width, e, cluster))
        else:
            # cross entropy on fp32 logits: read them, max/sum/log pass, backward writes
            # the grad
            parts.append((_stream_seconds(2 * tokens * width * 4, cluster, 2),
                          _stream_seconds(2 * tokens * width * 4, cluster, 1), 0.0))
    else:
        parts += _block_parts(shape, batch, tp, tokens, local, cluster, precision)
        if shape.engine == "megatron-2021":
            parts.append(_megatron_2021_block(shape, tokens, tp, cluster))
    return KernelTimes(*(sum(part[i] for part in parts) for i in range(3)))


def attention_core_seconds(shape: LayerShape, batch: int, tp: int, cluster: ClusterSpec,
                           precision: str) -> float:
    """Forward seconds of a block's attention core (softmax(QKᵀ)·V) on one of `tp` ranks:
    what selective recomputation redoes; 0 for embeddings and heads."""
    if shape.role != "block":
        return 0.0
    heads = math.ceil(shape.heads / tp)
    return _attention(shape.attention, batch * heads, shape.seq, shape.head_size,
                      shape.element, cluster, precision, shape.value_size)[0]


def _block_parts(shape: LayerShape, batch: int, tp: int, tokens: int, local: int,
                 cluster: ClusterSpec, precision: str) -> list[tuple[float, float, float]]:
    """A pre-norm block: LN, QKV, attention core, projection, dropout + residual, LN, FC1,
    bias-GeLU, FC2, dropout + residual (Megatron's kernels, biases fused); a gated MLP's
    FC1 is gate and up at once (2f wide), its activation reads both and writes one."""
    e, s, h = shape.element, shape.seq, shape.hidden
    width = math.ceil(shape.ffn / tp)
    heads = math.ceil(shape.heads / tp)
    head_size = shape.head_size
    inner = 2 if shape.gated else 1
    # LayerNorm reads and writes T·h (backward: reads x and dy, writes dx); Megatron's fused
    # bias-dropout-add reads x and the residual, writes the sum and a 1-byte mask (backward:
    # reads dy and the mask, writes dx)
    norm = _stream_seconds(2 * local * h * e, cluster)
    dropout_add = _stream_seconds(local * h * (3 * e + 1), cluster)
    parts = [(norm, 1.5 * norm, 0.0), (dropout_add, dropout_add, 0.0)] * 2
    parts += [times for _, times in block_linear_times(shape, batch, tp, cluster, precision)]
    if not shape.experts:  # a MoE MLP's activation: `expert_kernels`
        gelu = _stream_seconds((inner + 1) * tokens * width * e, cluster)
        parts.append((gelu, 1.5 * gelu, 0.0))
    parts.append(_attention(shape.attention, batch * heads, s, head_size, e, cluster,
                            precision, shape.value_size))
    if shape.latent is not None:  # its latent norms, whole on every rank over all T tokens
        latent = _stream_seconds(2 * tokens * sum(shape.latent.norm_widths()) * e, cluster,
                                 len(shape.latent.norm_widths()))
        parts.append((latent, 1.5 * latent, 0.0))
    return parts


def block_linear_times(shape: LayerShape, batch: int, tp: int, cluster: ClusterSpec,
                       precision: str
                       ) -> list[tuple[Literal["column", "row"],
                                       tuple[float, float, float]]]:
    """A block's four linears in order (qkv, proj, fc1 — gate and up at once when gated —,
    fc2), each its kind and (forward, input gradient, weight gradient) GEMM seconds on one
    of `tp` ranks: column- and row-parallel; a MoE block's (`LayerShape.routed`) attention
    pair only, its experts' GEMMs priced apart (`expert_kernels.expert_gemm_times`).
    Multi-head latent attention's qkv is its input side at once (`_latent_linears`)."""
    e, h, k = shape.element, shape.hidden, shape.kv_width
    tokens, width = batch * shape.seq, math.ceil(shape.ffn / tp)
    q = shape.heads * shape.head_size
    inner = 2 if shape.gated else 1
    attention: list[tuple[Literal["column", "row"], tuple[float, float, float]]] = [
        ("column", _linear(tokens, h, math.ceil((q + 2 * k) / tp), cluster, precision, e)),
        ("row", _linear(tokens, math.ceil(q / tp), h, cluster, precision, e))] \
        if shape.latent is None else \
        _latent_linears(shape.latent, shape, tokens, tp, cluster, precision)
    if shape.experts:
        return attention
    return [*attention, ("column", _linear(tokens, h, inner * width, cluster, precision, e)),
            ("row", _linear(tokens, width, h, cluster, precision, e))]


def _latent_linears(latent: LatentAttention, shape: LayerShape, tokens: int, tp: int,
                    cluster: ClusterSpec, precision: str
                    ) -> list[tuple[Literal["column", "row"],
                                    tuple[float, float, float]]]:
    """MLA's GEMMs on one of `tp` ranks as a block's two attention linears: "column" its
    input side, q_a and kv_a whole on every rank over all T tokens (the engine gathers the
    sequence at the attention's entry and runs them replicated) with q_b (or q_proj) and kv_b
    on the rank's heads, the sum of their times, behind the one collective that enters the
    region; "row" o on the rank's heads' a·d_v/t inputs."""
    column = [0.0, 0.0, 0.0]
    row = (0.0, 0.0, 0.0)
    for gemm in latent.gemms(shape.hidden, shape.heads, tp):
        times = _linear(tokens, gemm.inputs, gemm.outputs, cluster, precision, shape.element)
        if gemm.kind == "row":
            row = times
        else:
            column = [total + part for total, part in zip(column, times)]
    return [("column", (column[0], column[1], column[2])), ("row", row)]


def _attention(kind: str, batch: int, s: int, d: int, e: int, cluster: ClusterSpec,
               precision: str, d_v: int = 0) -> tuple[float, float, float]:
    """softmax(QKᵀ/√d)·V for `batch` = b·a/t heads of s tokens, head size d (Q, K) and d_v
    (V; 0: d, MLA's v_head_dim).

    eager: QKᵀ and PV as batched GEMMs, the s × s scores through memory: a fused scale-mask-
    softmax (read, write) and dropout (read, write, 1-byte mask); backward twice the GEMMs
    and three passes over the scores each. fused: FlashAttention, no scores in memory: its
    GEMM work at `_FUSED_ATTENTION` of a GEMM's rate; backward 2.5× (it recomputes QKᵀ)."""
    def bmm(m: int, n: int, k: int, efficiency: float = 1.0) -> float:
        return gemm_seconds(m, n, k, cluster, precision, batch=batch, efficiency=efficiency,
                            element=e)

    d_v = d_v or d
    if kind == "fused":
        forward = bmm(s, s, d, _FUSED_ATTENTION) + bmm(s, d_v, s, _FUSED_ATTENTION) \
            - cluster.kernel_overhead
        return forward, 2.5 * forward, 0.0
    scores = batch * s * s
    forward = bmm(s, s, d) + bmm(s, d_v, s) + _stream_seconds(scores * (4 * e + 1), cluster, 2)
    backward = 2 * (bmm(s, s, d) + bmm(s, d_v, s)) + _stream_seconds(scores * (5 * e + 1),
                                                                       cluster, 2)
    return forward, backward, 0.0


def _megatron_2021_cross_entropy(logits: int, e: int, cluster: ClusterSpec
                                 ) -> tuple[float, float, float]:
    """Megatron-LM 2021's loss on one rank's `logits` (T·V/t) elements of e bytes
    (`gpt_model.post_language_model_processing` without --fp16-lm-cross-entropy, which the
    paper's scripts do not set: `vocab_parallel_cross_entropy(output.float(), labels)`;
    `mpu/cross_entropy.py`, commit f32a638d2d): forward the fp32 copy (read e, write 4),
    max (read 4), subtract it in place (read, write), exp in place (read, write), sum
    (read), divide in place to keep the softmax (read, write): 6 kernels, 36 + e bytes an
    element; backward multiplies the softmax by the loss's gradient in place (read, write)
    and the copy's backward casts it back (read 4, write e): 2 kernels, 12 + e bytes."""
    return (_stream_seconds(logits * (36 + e), cluster, 6),
            _stream_seconds(logits * (12 + e), cluster, 2), 0.0)


def _megatron_2021_block(shape: LayerShape, tokens: int, tp: int, cluster: ClusterSpec
                         ) -> tuple[float, float, float]:
    """Element-wise passes Megatron-LM's block of 2021 (`model/transformer.py`, commit
    f32a638d2d; torch 1.8 of the scripts' container, nvcr.io/nvidia/pytorch:20.12-py3;
    apex's fused LayerNorm) runs besides `_block_parts`' fused ones, each over T tokens
    (t: tp; widths per tp rank):

    forward: the QKV bias added after the GEMM (`ColumnParallelLinear` passes it to
    F.linear, whose input [s, b, h] is 3-D: torch fused the bias into addmm for 2-D input
    only until pytorch/pytorch#72728, 2022, so matmul then `add_`: read, write 3h/t); the
    context's `permute(2, 0, 1, 3).contiguous()` (read, write h/t);
    backward: the QKV bias's gradient (a sum over T: read 3h/t); `split_tensor_along_last_
    dim`'s backward, torch.split's: the three gradients concatenated (read, write 3h/t);
    baddbmm's backward scales dQ and dK by its alpha = 1/√d (derivatives.yaml
    `maybe_multiply(..., alpha)`: read, write 2h/t); the bias gradients of the fused GeLU
    (`GeLUFunction` returns a full-shape gradient for the bias, reduced by autograd: read
    f/t) and of both bias-dropout-adds (`bias.expand_as(residual)`'s backward, a sum: read
    h each); apex's LayerNorm backward reads its input and output gradient twice, once for
    the weight and bias gradients (`cuComputePartGradGammaBeta`) and once for the input's
    (`cuComputeGradInput`): 2h more each, two norms.

    The recomputation reruns the forward's (the stage prices it as the forward)."""
    e, h = shape.element, shape.hidden
    q = math.ceil(shape.heads * shape.head_size / tp)
    qkv = math.ceil((shape.heads * shape.head_size + 2 * shape.kv_width) / tp)
    width = math.ceil(shape.ffn / tp)
    forward = _stream_seconds(tokens * (2 * qkv + 2 * q) * e, cluster, 2)
    backward = _stream_seconds(tokens * (qkv + 2 * qkv + 4 * q + width + 2 * h + 4 * h) * e,
                               cluster, 7)
    return forward, backward, 0.0
