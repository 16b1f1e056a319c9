"""`tensor_parallel_hf`'s layer factories: build the plain layer on its rank, keep the slice."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from pipeline.interop.hf_modules import (
    GPT2Positions,
    HFBlock,
    HFEmbedding,
    SoftCappedHead,
    _soft_cap,
    _tied_head,
)
from pipeline.interop.hf_modules_tp import (
    ParallelEmbedding,
    ParallelHFBlock,
    ParallelLMHead,
    Region,
    SequenceSwitch,
    enter_on_call,
    vocab_logits,
)
from pipeline.interop.hf_moe_modules import MoEBlock, MoEEmbedding, MoEHead
from pipeline.interop.hf_moe_tp import ParallelMoEHead, parallel_moe_block
from pipeline.interop.hf_overlap import fuse_columns_on_call
from pipeline.interop.hf_tp_losses import TensorParallelPlan
from pipeline.interop.hf_tp_sizes import check_tensor_parallel_size
from pipeline.interop.hf_tp_split import column_names, split_attention, split_gpt2, split_mlp
from pipeline.model.layer_rng import tensor_parallel_rank_stream
from pipeline.model.layers import LayerSpec
from pipeline.parallel.tensor.collectives import tp_rank_and_size
from pipeline.parallel.tensor.sequence import sum_gradient_over_tensor_parallel
from pipeline.parallel.tensor.split_check import mark_replicated

# The factories keep their private names (`LayerSpec.name` is the factory's __name__);
# `hf_tensor_parallel` and `hf_context_parallel` import them by those names.
__all__: list[str] = []


def _built(original: LayerSpec, size: int, config: Any) -> nn.Module:
    """The plain layer; a copy when it is a given model's own module about to be sliced.
    Every layer checks the tp size, so every rank refuses a bad one while it builds."""
    if size > 1:
        check_tensor_parallel_size(config, size)
    module = original.build()
    return copy.deepcopy(module) if size > 1 and _from_model(original) else module


def _from_model(original: LayerSpec) -> bool:
    return any(isinstance(arg, nn.Module) for arg in original.args)


def _embedding(make: Any, plan: TensorParallelPlan, group: ProcessGroup | None = None) -> nn.Module:
    full = make()
    if tp_rank_and_size(group)[1] == 1:
        return full
    check_tensor_parallel_size(plan.config, tp_rank_and_size(group)[1])
    return ParallelEmbedding(full, Region(group, plan.sequence_parallel))


def _untied_embedding(make: Any, plan: TensorParallelPlan,
                      group: ProcessGroup | None = None) -> nn.Module:
    return HFEmbedding(_embedding(make, plan, group))


def _parallel_tied_head(module: nn.Module, hidden: torch.Tensor, *, plan: TensorParallelPlan,
                        softcap: float | None) -> torch.Tensor:
    if not isinstance(module, ParallelEmbedding):
        return _tied_head(module, hidden, softcap=softcap)
    return _soft_cap(vocab_logits(hidden, module.weight, module.region, plan.slot,
                                  module.vocab_start), softcap)


def _head(original: LayerSpec, plan: TensorParallelPlan,
          group: ProcessGroup | None = None) -> nn.Module:
    _, size = tp_rank_and_size(group)
    module = _built(original, size, plan.config)
    if size == 1:
        return module
    region = Region(group, plan.sequence_parallel)
    if isinstance(module, SoftCappedHead):
        return SoftCappedHead(ParallelLMHead(module.head, region, plan.slot), module.softcap)
    return ParallelLMHead(module, region, plan.slot)


def _replicated(original: LayerSpec, plan: TensorParallelPlan, group: ProcessGroup | None = None
                ) -> nn.Module:
    """The final norm (and GPT-2's positions): whole on every rank; with sequence
    parallelism each rank sees its part of the tokens, so gradients are summed."""
    _, size = tp_rank_and_size(group)
    module = _built(original, size, plan.config)
    if size == 1:
        return module
    if plan.sequence_parallel:
        for param in module.parameters():
            sum_gradient_over_tensor_parallel(param, group)
        if isinstance(module, GPT2Positions):
            module = _SequencePositions(module, group)
    return mark_replicated(module)


class _SequencePositions(SequenceSwitch, GPT2Positions):
    """GPT-2's positions added to this rank's part of the sequence (all of it while
    generating, `SequenceSwitch`)."""

    def __init__(self, positions: GPT2Positions, group: ProcessGroup | None) -> None:
        super().__init__(positions.wpe, positions.drop.p)
        self.region = Region(group, sequence_parallel=True)
        self.rank, self.size = tp_rank_and_size(group)

    def forward(self, value: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if not self.region.splits_sequence:
            return super().forward(value)
        hidden, positions, *rest = value
        mine = positions.chunk(self.size, dim=-1)[self.rank]
        with tensor_parallel_rank_stream(self.rank):  # this rank's tokens' own masks
            return (self.drop(hidden + self.wpe(mine)), positions, *rest)


def _block(original: LayerSpec, plan: TensorParallelPlan,
           group: ProcessGroup | None = None) -> nn.Module:
    rank, size = tp_rank_and_size(group)
    block = _built(original, size, plan.config)
    if size == 1:
        return block
    assert isinstance(block, HFBlock)
    region = Region(group, plan.sequence_parallel, plan.overlap, plan.chunks, plan.ops)
    layer: Any = block.layer
    gpt2 = plan.config.model_type == "gpt2"
    if gpt2:
        split_gpt2(layer, plan.config, region)
        attention, mlp = layer.attn, layer.mlp
    else:
        split_attention(layer.self_attn, plan.config, region, rank, size)
        split_mlp(layer.mlp, region)
        attention, mlp = layer.self_attn, layer.mlp
    if region.runs_overlap_functions:  # one fused column GEMM per module (q;k;v, gate;up)
        for module in (attention, mlp):
            fuse_columns_on_call(module, column_names(module), region, transposed=gpt2)
    else:
        enter_on_call(attention, region)
        enter_on_call(mlp, region)
    if plan.sequence_parallel:  # norms and residual-side weights see 1/t of the tokens
        inside = {id(p) for part in (attention, mlp) for p in part.parameters()}
        for param in layer.parameters():
            if id(param) not in inside:
                sum_gradient_over_tensor_parallel(param, group)
    return ParallelHFBlock(block, region, size)


def _moe_embedding(original: LayerSpec, plan: TensorParallelPlan,
                   group: ProcessGroup | None = None) -> nn.Module:
    _, size = tp_rank_and_size(group)
    module = _built(original, size, plan.config)
    if size == 1:
        return module
    assert isinstance(module, MoEEmbedding)
    return MoEEmbedding(ParallelEmbedding(module.embedding,
                                          Region(group, plan.sequence_parallel)))


def _moe_block(original: LayerSpec, plan: TensorParallelPlan,
               group: ProcessGroup | None = None) -> nn.Module:
    _, size = tp_rank_and_size(group)
    block = _built(original, size, plan.config)
    if size == 1:
        return block
    assert isinstance(block, MoEBlock)
    return parallel_moe_block(block, plan.config, Region(group, plan.sequence_parallel,
                                                         plan.overlap, plan.chunks, plan.ops))


def _moe_head(original: LayerSpec, plan: TensorParallelPlan,
              group: ProcessGroup | None = None) -> nn.Module:
    _, size = tp_rank_and_size(group)
    module = _built(original, size, plan.config)
    if size == 1:
        return module
    assert isinstance(module, MoEHead)
    return ParallelMoEHead(module, Region(group, plan.sequence_parallel), plan.slot)
