"""Megatron-style tensor-parallel layers and a transformer block split by heads and MLP columns.

Every layer is built from a full-size layer and keeps its tp rank's slice, as Megatron does
with `use_cpu_initialization`: seed all tp ranks alike (and like the single-process model)
and the shards are exact slices of the plain layer, so results do not depend on tp.
`from_full(layer, group)` slices an existing full-size layer instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from pipeline.parallel.tensor.collectives import (
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    scatter_to_tensor_parallel_region,
    tp_rank_and_size,
)
from pipeline.parallel.tensor.overlap import (
    REAL_OPS,
    TensorParallelOps,
    column_parallel_linear,
    reduce_grad,
    row_parallel_linear,
)
from pipeline.parallel.tensor.shard_layout import ShardLayout, mark_sharded
from pipeline.recompute_region import recompute_region

__all__ = [
    "ColumnParallelLinear",
    "ParallelTransformerBlock",
    "RowParallelLinear",
    "TransformerBlock",
    "VocabParallelEmbedding",
    "parallel_lm_logits",
]


def _divide(value: int, parts: int, what: str) -> int:
    if value % parts:
        raise ValueError(f"{what} = {value} is not divisible by the tensor-parallel size "
                         f"{parts}; choose {what} as a multiple of tp")
    return value // parts


def _rows(full: torch.Tensor, parts: int, index: int, fused_parts: int = 1) -> torch.Tensor:
    """Rank `index`'s rows of `full`, which stacks `fused_parts` equal blocks (e.g. Q;K;V),
    each split over `parts` ranks; the result stacks this rank's slice of every block."""
    blocks = full.chunk(fused_parts, dim=0)
    return torch.cat([block.chunk(parts, dim=0)[index] for block in blocks]).clone()


class ColumnParallelLinear(nn.Module):
    """Y = X A with A split by columns (output features): rank i computes X A_i.

    Input passes through f (identity forward, all-reduce backward); the output stays split
    unless `gather_output`. `fused_parts` > 1 splits each of that many stacked output blocks
    separately (a fused Q;K;V projection keeps whole heads on each rank).

    `sequence_parallel`: the input is this rank's slice of the sequence, all-gathered here
    (backward: reduce-scattered). `overlap`: the collectives run beside the GEMMs
    (`overlap.column_parallel_linear`, `chunks` slices of the forward gather).
    """

    def __init__(self, in_features: int, out_features: int, group: ProcessGroup | None, *,
                 bias: bool = True, gather_output: bool = False, fused_parts: int = 1,
                 full: nn.Linear | None = None, sequence_parallel: bool = False,
                 overlap: bool = False, chunks: int = 2,
                 ops: TensorParallelOps = REAL_OPS) -> None:
        super().__init__()
        rank, size = tp_rank_and_size(group)
        _divide(out_features, size * fused_parts, "out_features / fused_parts · tp")
        if gather_output and sequence_parallel:
            raise ValueError("gather_output=True with sequence_parallel=True: a gathered "
                             "output leaves the sequence-parallel region; gather it with "
                             "gather_from_sequence_parallel_region instead")
        if full is None:
            full = nn.Linear(in_features, out_features, bias=bias)
        self.group, self.gather_output = group, gather_output
        self.sequence_parallel, self.overlap, self.chunks, self.ops = (
            sequence_parallel, overlap, chunks, ops)
        self.in_features, self.out_features = in_features, out_features
        # how the rows were cut (each fused block separately), for checkpoints under another tp
        layout = ShardLayout(0, (out_features // fused_parts,) * fused_parts, rank, size)
        self.weight = mark_sharded(
            nn.Parameter(_rows(full.weight.detach(), size, rank, fused_parts)), layout)
        self.bias: nn.Parameter | None = None
        if full.bias is not None:
            self.bias = mark_sharded(
                nn.Parameter(_rows(full.bias.detach(), size, rank, fused_parts)), layout)

    @classmethod
    def from_full(cls, full: nn.Linear, group: ProcessGroup | None, *,
                  gather_output: bool = False, fused_parts: int = 1,
                  sequence_parallel: bool = False, overlap: bool = False, chunks: int = 2,
                  ops: TensorParallelOps = REAL_OPS) -> ColumnParallelLinear:
        return cls(full.in_features, full.out_features, group, bias=full.bias is not None,
                   gather_output=gather_output, fused_parts=fused_parts, full=full,
                   sequence_parallel=sequence_parallel, overlap=overlap, chunks=chunks,
                   ops=ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel or self.overlap or self.ops is not REAL_OPS:
            y = column_parallel_linear(x, self.weight, self.group,
                                       sequence_parallel=self.sequence_parallel,
                                       overlap=self.overlap, chunks=self.chunks, ops=self.ops)
            y = y if self.bias is None else y + self.bias
        else:
            y = F.linear(copy_to_tensor_parallel_region(x, self.group), self.weight, self.bias)
        return gather_from_tensor_parallel_region(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X A with A split by rows (input features): rank i computes X_i A_i, then g sums.

    The bias is added once, after the all-reduce, so it is replicated (not a tp slice) and
    its gradient is identical on every tp rank.

    `sequence_parallel`: the sum is reduce-scattered along the sequence (each rank keeps its
    slice; the bias's gradient is all-reduced over tp). `overlap`: the output is made in
    `chunks` column slices, each one's collective beside the next one's GEMM.
    """

    def __init__(self, in_features: int, out_features: int, group: ProcessGroup | None, *,
                 bias: bool = True, input_is_parallel: bool = True,
                 full: nn.Linear | None = None, sequence_parallel: bool = False,
                 overlap: bool = False, chunks: int = 2,
                 ops: TensorParallelOps = REAL_OPS) -> None:
        super().__init__()
        rank, size = tp_rank_and_size(group)
        _divide(in_features, size, "in_features")
        if full is None:
            full = nn.Linear(in_features, out_features, bias=bias)
        self.group, self.input_is_parallel = group, input_is_parallel
        self.sequence_parallel, self.overlap, self.chunks, self.ops = (
            sequence_parallel, overlap, chunks, ops)
        self.in_features, self.out_features = in_features, out_features
        self.weight = mark_sharded(
            nn.Parameter(full.weight.detach().chunk(size, dim=1)[rank].clone()),
            ShardLayout(1, (in_features,), rank, size))
        self.bias: nn.Parameter | None = None
        if full.bias is not None:
            self.bias = nn.Parameter(full.bias.detach().clone())

    @classmethod
    def from_full(cls, full: nn.Linear, group: ProcessGroup | None, *,
                  input_is_parallel: bool = True, sequence_parallel: bool = False,
                  overlap: bool = False, chunks: int = 2,
                  ops: TensorParallelOps = REAL_OPS) -> RowParallelLinear:
        return cls(full.in_features, full.out_features, group, bias=full.bias is not None,
                   input_is_parallel=input_is_parallel, full=full,
                   sequence_parallel=sequence_parallel, overlap=overlap, chunks=chunks,
                   ops=ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.group)
        if self.sequence_parallel or self.overlap or self.ops is not REAL_OPS:
            y = row_parallel_linear(x, self.weight, self.group,
                                    sequence_parallel=self.sequence_parallel,
                                    overlap=self.overlap, chunks=self.chunks, ops=self.ops)
        else:
            y = reduce_from_tensor_parallel_region(F.linear(x, self.weight), self.group)
        if self.bias is None:
            return y
        bias: torch.Tensor = self.bias
        if self.sequence_parallel:
            bias = reduce_grad(bias, self.group, self.ops)
        return y + bias


class VocabParallelEmbedding(nn.Module):
    """An embedding whose vocabulary rows are split over tp: each rank looks up the ids in
    its range [start, end), contributes zeros for the others, and g sums the parts."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group: ProcessGroup | None, *,
                 full: nn.Embedding | None = None) -> None:
        super().__init__()
        rank, size = tp_rank_and_size(group)
        per_rank = _divide(num_embeddings, size, "num_embeddings (vocabulary size)")
        if full is None:
            full = nn.Embedding(num_embeddings, embedding_dim)
        self.group = group
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start, self.vocab_end = rank * per_rank, (rank + 1) * per_rank
        self.weight = mark_sharded(
            nn.Parameter(full.weight.detach()[self.vocab_start:self.vocab_end].clone()),
            ShardLayout(0, (num_embeddings,), rank, size))

    @classmethod
    def from_full(cls, full: nn.Embedding, group: ProcessGroup | None
                  ) -> VocabParallelEmbedding:
        return cls(full.num_embeddings, full.embedding_dim, group, full=full)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel_region(out, self.group)


def parallel_lm_logits(hidden: torch.Tensor, embedding: VocabParallelEmbedding, *,
                       gather_output: bool = True) -> torch.Tensor:
    """Output head tied to a vocab-parallel embedding: logits = hidden · Eᵀ, each rank its
    vocabulary slice (a column-parallel layer whose weight is the embedding's)."""
    hidden = copy_to_tensor_parallel_region(hidden, embedding.group)
    logits = F.linear(hidden, embedding.weight)
    return gather_from_tensor_parallel_region(logits, embedding.group) if gather_output \
        else logits


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
               causal: bool) -> torch.Tensor:
    """Scaled dot-product attention over (batch, seq, heads · head_dim) tensors."""
    batch, seq, width = q.shape

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.view(batch, seq, heads, width // heads).transpose(1, 2)

    out = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=causal)
    return out.transpose(1, 2).reshape(batch, seq, width)


class TransformerBlock(nn.Module):
    """Plain pre-LN transformer block (the single-process reference for the parallel one):
    x + proj(attention(qkv(ln1(x)))), then x + fc2(gelu(fc1(ln2(x))))."""

    def __init__(self, hidden: int, num_heads: int, *, ffn_hidden: int | None = None,
                 causal: bool = True) -> None:
        super().__init__()
        if hidden % num_heads:
            raise ValueError(f"hidden = {hidden} is not divisible by num_heads = {num_heads}")
        ffn_hidden = 4 * hidden if ffn_hidden is None else ffn_hidden
        self.hidden, self.num_heads, self.ffn_hidden, self.causal = (
            hidden, num_heads, ffn_hidden, causal)
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn_hidden)
        self.fc2 = nn.Linear(ffn_hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        x = x + self.proj(_attention(q, k, v, self.num_heads, self.causal))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ParallelTransformerBlock(nn.Module):
    """`TransformerBlock` with attention heads and MLP columns split over tp (Megatron §3):
    qkv and fc1 column-parallel, proj and fc2 row-parallel, so one all-reduce forward and one
    backward per sub-layer. Layer norms are replicated: their inputs are identical on every
    tp rank, hence so are their gradients.

    `sequence_parallel` (Korthikanti et al. 2022): the block's input and output are this
    rank's slice of the sequence (dim 1, `sequence.SEQUENCE_DIM`); norms and residuals run on
    the slice, an all-gather precedes qkv and fc1, a reduce-scatter follows proj and fc2, and
    the norms' gradients are all-reduced over tp. Enter and leave with
    `sequence.ScatterSequence` / `sequence.GatherSequence` around the blocks.
    `overlap`: the collectives run beside the GEMMs (`overlap`, `chunks` slices); `ops` is
    the GEMM / collective seam (emulated devices replace it)."""

    def __init__(self, hidden: int, num_heads: int, group: ProcessGroup | None, *,
                 ffn_hidden: int | None = None, causal: bool = True,
                 full: TransformerBlock | None = None, sequence_parallel: bool = False,
                 overlap: bool = False, chunks: int = 2,
                 ops: TensorParallelOps = REAL_OPS) -> None:
        super().__init__()
        _, size = tp_rank_and_size(group)
        if full is None:
            full = TransformerBlock(hidden, num_heads, ffn_hidden=ffn_hidden, causal=causal)
        elif (full.hidden, full.num_heads) != (hidden, num_heads):
            raise ValueError(f"full block has hidden={full.hidden}, num_heads={full.num_heads}"
                             f" but hidden={hidden}, num_heads={num_heads} were asked for")
        self.local_heads = _divide(full.num_heads, size, "num_heads")
        _divide(full.ffn_hidden, size, "ffn_hidden")
        self.causal, self.group, self.sequence_parallel = full.causal, group, sequence_parallel
        self.ops = ops
        self.ln1 = nn.LayerNorm(full.hidden)
        self.ln2 = nn.LayerNorm(full.hidden)
        self.ln1.load_state_dict(full.ln1.state_dict())
        self.ln2.load_state_dict(full.ln2.state_dict())
        sp = sequence_parallel
        self.qkv = ColumnParallelLinear.from_full(full.qkv, group, fused_parts=3,
                                                  sequence_parallel=sp, overlap=overlap,
                                                  chunks=chunks, ops=ops)
        self.proj = RowParallelLinear.from_full(full.proj, group, sequence_parallel=sp,
                                                overlap=overlap, chunks=chunks, ops=ops)
        self.fc1 = ColumnParallelLinear.from_full(full.fc1, group, sequence_parallel=sp,
                                                  overlap=overlap, chunks=chunks, ops=ops)
        self.fc2 = RowParallelLinear.from_full(full.fc2, group, sequence_parallel=sp,
                                               overlap=overlap, chunks=chunks, ops=ops)

    @classmethod
    def from_full(cls, full: TransformerBlock, group: ProcessGroup | None, *,
                  sequence_parallel: bool = False, overlap: bool = False, chunks: int = 2,
                  ops: TensorParallelOps = REAL_OPS) -> ParallelTransformerBlock:
        return cls(full.hidden, full.num_heads, group, full=full,
                   sequence_parallel=sequence_parallel, overlap=overlap, chunks=chunks,
                   ops=ops)

    def _norm(self, norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
        """`norm(x)`; on a sequence slice its weights' gradients are all-reduced over tp."""
        if not self.sequence_parallel:
            return norm(x)
        return F.layer_norm(x, norm.normalized_shape,
                            reduce_grad(norm.weight, self.group, self.ops),
                            reduce_grad(norm.bias, self.group, self.ops), norm.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self._norm(self.ln1, x)).chunk(3, dim=-1)
        # attention's core is the block's recompute region: selective recomputation keeps
        # Q, K, V and redoes it in the backward (Korthikanti et al. 2022, section 4.2)
        x = x + self.proj(recompute_region(self._core, q, k, v))
        return x + self.fc2(F.gelu(self.fc1(self._norm(self.ln2, x))))

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _attention(q, k, v, self.local_heads, self.causal)

