"""Tensor-parallel pieces of a HF model: a vocab-parallel embedding and head, a row-parallel
projection, a head-selecting projection, and the block that enters and leaves tp regions.

Each is built from the full HF module and keeps this rank's slice (`ShardLayout`), so its
parameter names are HF's (``self_attn.o_proj.weight``) and loads / exports map by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from pipeline.interop.hf_modules import HFBlock
from pipeline.model.layer_rng import tensor_parallel_rank_stream
from pipeline.parallel.tensor.collectives import (
    copy_to_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    tp_rank_and_size,
)
from pipeline.parallel.tensor.overlap import (
    REAL_OPS,
    TensorParallelOps,
    column_parallel_linear,
    row_parallel_linear,
)
from pipeline.parallel.tensor.sequence import (
    SEQUENCE_DIM,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    sum_gradient_over_tensor_parallel,
)
from pipeline.parallel.tensor.shard_layout import ShardLayout, mark_sharded

__all__ = ["HeadRows", "ParallelEmbedding", "ParallelHFBlock", "ParallelLMHead", "Region",
           "RowParallel", "SequenceSwitch", "VocabSlot", "shard_parameter"]


@dataclass(eq=False)
class Region:
    """How a rank enters a column-parallel region and leaves a row-parallel one: with
    `overlap`, inside the linear layers, their collectives beside the GEMMs
    (`pipeline.parallel.tensor.overlap`, `chunks` slices; `ops` the GEMM / collective seam
    that emulated devices replace)."""

    group: ProcessGroup | None
    sequence_parallel: bool
    overlap: bool = False
    chunks: int = 2
    ops: TensorParallelOps = field(default=REAL_OPS, compare=False)
    whole_sequence: bool = False
    """Set while generating (`SequenceSwitch`): the sequence-parallel parts see the whole
    sequence, as Megatron runs inference without sequence parallelism (the same weights;
    a decoding step's one new token cannot be split over t ranks)."""

    @property
    def splits_sequence(self) -> bool:
        """Whether the carried hidden states hold 1/t of the sequence now."""
        return self.sequence_parallel and not self.whole_sequence

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """f (identity; all-reduce backward), or with sequence parallelism all-gather the
        sequence (reduce-scatter backward)."""
        if self.splits_sequence:  # contiguous: HF's Conv1D views its input
            return gather_from_sequence_parallel_region(x, self.group).contiguous()
        return copy_to_tensor_parallel_region(x, self.group)

    def leave(self, y: torch.Tensor) -> torch.Tensor:
        """g (all-reduce; identity backward), or reduce-scatter over the sequence."""
        if self.splits_sequence:  # (batch, seq, hidden) order in memory, as HF's own
            return reduce_scatter_to_sequence_parallel_region(y, self.group).contiguous()
        return reduce_from_tensor_parallel_region(y, self.group)

    @property
    def runs_overlap_functions(self) -> bool:
        """Whether the blocks' linears run through `pipeline.parallel.tensor.overlap`: with
        `overlap`, with emulated `ops`, or with sequence parallelism (without `overlap`,
        their sequential baseline), as the engine's own layers. Under sequence parallelism
        its column layer keeps this rank's sequence slice for the weight gradient and
        gathers it again in the backward (Megatron's way), where an all-gather before HF's
        own Linear would have it keep the whole gathered input."""
        return self.overlap or self.ops is not REAL_OPS or self.sequence_parallel

    def column(self, x: torch.Tensor, weight: torch.Tensor | list[torch.Tensor]
               ) -> torch.Tensor:
        """x Wᵀ for this rank's rows W (Linear's layout, or its row blocks) of a column-
        parallel layer, `x` entering the region inside it (`column_parallel_linear`)."""
        return column_parallel_linear(x, weight, self.group,
                                      sequence_parallel=self.splits_sequence,
                                      overlap=self.overlap, chunks=self.chunks, ops=self.ops)

    def row(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Σ over tp of x Wᵀ for this rank's columns W (Linear's layout), leaving the region
        inside it (`row_parallel_linear`)."""
        return row_parallel_linear(x, weight, self.group,
                                   sequence_parallel=self.splits_sequence,
                                   overlap=self.overlap, chunks=self.chunks, ops=self.ops)


class SequenceSwitch:
    """A module whose `region` generation can run over the whole sequence: it calls
    ``pipesched_whole_sequence(True)`` on every module that has it before decoding and
    ``(False)`` after (`pipeline.runtime.generation.WHOLE_SEQUENCE`). The block's attention
    and MLP hooks share the block's region, so one switch turns the whole block."""

    region: Region

    def pipesched_whole_sequence(self, whole: bool) -> None:
        self.region.whole_sequence = whole


class VocabSlot:
    """Where the vocab-parallel head tells the loss its tp group and vocabulary offset (set
    on every forward of the head, read by the loss just after, on the last stage)."""

    def __init__(self) -> None:
        self.group: ProcessGroup | None = None
        self.vocab_start = 0


def shard_parameter(param: torch.Tensor, dim: int, blocks: tuple[int, ...],
                    group: ProcessGroup | None) -> nn.Parameter:
    """A new parameter holding this rank's part of `param` (see `ShardLayout`)."""
    rank, size = tp_rank_and_size(group)
    layout = ShardLayout(dim, blocks, rank, size)
    return mark_sharded(nn.Parameter(layout.shard(param.detach()),
                                     requires_grad=param.requires_grad), layout)


class RowParallel(SequenceSwitch, nn.Module):
    """A Linear (or GPT-2 Conv1D, `transposed`) split by input features: this rank's partial
    product leaves the region (summed over tp), then the bias is added once."""

    def __init__(self, full: Any, region: Region, *, transposed: bool = False) -> None:
        super().__init__()
        self.region, self.transposed = region, transposed
        weight: nn.Parameter = full.weight
        self.weight = shard_parameter(weight, 0 if transposed else 1,
                                      (weight.shape[0 if transposed else 1],), region.group)
        self.bias: nn.Parameter | None = full.bias
        if self.bias is not None and region.sequence_parallel:  # added to 1/t of the tokens
            sum_gradient_over_tensor_parallel(self.bias, region.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.region.runs_overlap_functions:
            y = self.region.row(x, self.weight.t() if self.transposed else self.weight)
        else:
            y = self.region.leave(x @ self.weight if self.transposed
                                  else F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class HeadRows(nn.Module):
    """A key or value projection every tp rank holds whole (tp does not divide the kv heads:
    each kv head serves t / kv ranks), computing only the rows of the head this rank's query
    heads read; its gradient is summed over tp (each rank fills only its head's rows)."""

    def __init__(self, full: Any, rows: slice, group: ProcessGroup | None) -> None:
        super().__init__()
        self.weight, self.bias, self.rows = full.weight, full.bias, rows
        for param in (self.weight, self.bias):
            if param is not None:
                sum_gradient_over_tensor_parallel(param, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias[self.rows]
        return F.linear(x, self.weight[self.rows], bias)


class ParallelEmbedding(SequenceSwitch, nn.Module):
    """The token embedding with its vocabulary rows split over tp (`torch.tensor_split`
    parts): each rank looks up the ids in its range, zeros elsewhere, then the parts are
    summed (g), or with sequence parallelism reduce-scattered over the sequence. Keeps HF's
    ``padding_idx`` and Gemma's ``embed_scale``; also the tied output head's weight."""

    pipesched_splits_vocabulary = True  # as the tied head (pipeline.runtime.generation)

    def __init__(self, full: Any, region: Region) -> None:
        super().__init__()
        self.region = region
        self.num_embeddings = full.num_embeddings
        self.weight = shard_parameter(full.weight, 0, (full.num_embeddings,), region.group)
        rank, size = tp_rank_and_size(region.group)
        (self.vocab_start, self.vocab_end), = ShardLayout(
            0, (full.num_embeddings,), rank, size).ranges()
        pad = full.padding_idx
        self.padding_idx = pad - self.vocab_start if pad is not None and \
            self.vocab_start <= pad < self.vocab_end else None
        scale = getattr(full, "embed_scale", None)
        self.embed_scale: torch.Tensor | None
        self.register_buffer("embed_scale", None if scale is None else scale.clone(),
                             persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self.padding_idx)
        if self.embed_scale is not None:
            out = out * self.embed_scale.to(self.weight.dtype)
        return self.region.leave(out.masked_fill(outside.unsqueeze(-1), 0.0))


def vocab_logits(hidden: torch.Tensor, weight: torch.Tensor, region: Region, slot: VocabSlot,
                 vocab_start: int) -> torch.Tensor:
    """This rank's vocabulary slice of the logits (the full sequence), telling `slot`."""
    slot.group, slot.vocab_start = region.group, vocab_start
    return F.linear(region.enter(hidden), weight)


class ParallelLMHead(SequenceSwitch, nn.Module):
    """An untied lm_head split by vocabulary rows: logits stay split for the loss."""

    pipesched_splits_vocabulary = True  # pipeline.runtime.generation.SPLITS_VOCABULARY

    def __init__(self, full: Any, region: Region, slot: VocabSlot) -> None:
        super().__init__()
        self.region, self.slot = region, slot
        self.weight = shard_parameter(full.weight, 0, (full.out_features,), region.group)
        rank, size = tp_rank_and_size(region.group)
        (self.vocab_start, _), = ShardLayout(0, (full.out_features,), rank, size).ranges()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return vocab_logits(hidden, self.weight, self.region, self.slot, self.vocab_start)


class ParallelHFBlock(SequenceSwitch, HFBlock):
    """`HFBlock` whose decoder layer was split over tp. With sequence parallelism the
    carried hidden states hold 1/t of the sequence; the mask is built for the whole one.
    While generating (`SequenceSwitch`) it runs as a plain tp block, cache included."""

    def __init__(self, block: HFBlock, region: Region, size: int) -> None:
        super().__init__(block.layer, block.config, block.mask_function, block.rotary,
                         block.rotary_layer_type,
                         generation_eos=block.generation_eos_token_id,
                         generation_pad=block.generation_pad_token_id)
        self.region, self.size = region, size

    def forward(self, value: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if not self.region.splits_sequence:
            return super().forward(value)
        hidden, positions, *rest = value
        attention_mask = rest[0] if rest else None
        batch, _, width = hidden.shape
        whole = hidden[:, :1].expand(batch, hidden.shape[SEQUENCE_DIM] * self.size, width)
        mask = self.mask_function(self.config, whole, attention_mask, None, positions)
        with tensor_parallel_rank_stream(tp_rank_and_size(self.region.group)[0]):
            # this rank's tokens (and heads): dropout masks of their own, as Megatron's
            return (self.attend(hidden, mask, positions, None), positions, *rest)


def enter_on_call(module: nn.Module, region: Region) -> None:
    """Pass `module`'s hidden-states input (first positional or ``hidden_states=``) through
    ``region.enter`` on every call."""
    def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args:
            return (region.enter(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": region.enter(kwargs["hidden_states"])}

    module.register_forward_pre_hook(hook, with_kwargs=True)
