"""Tensor parallelism for HF mixture-of-experts layers: attention and dense MLPs split over tp,
each expert whole on its ep rank (expert tensor parallelism 1), each token routed once.

As Megatron-Core with ``expert_tensor_parallel_size=1`` (its default), one tp rank of a
stage computes the MoE layer for 1/t of the tokens (legend: t = tp, e = ep)::

    sequence parallel:  tokens arrive sliced over tp ─> route own slice ─> experts ─> slice
    without:            tokens replicated ─> keep own 1/t slice (scatter) ─> route ─> experts
                        ─> all-gather the slices (backward: keep own slice's gradient)

The all-to-all then runs over the ep ranks that share this tp rank (`Topology.ep_group`),
so each token is dispatched once, by the tp rank holding it. Every tp rank of an ep rank
holds the same experts, router and shared experts whole; each sees 1/t of the tokens, so
their gradients are summed over tp (`sum_gradient_over_tensor_parallel`), as a norm's under
sequence parallelism. The balancing-loss share each rank carries covers its own tokens; the
head sums it over tp (g: all-reduce forward, identity backward), so every tp rank's loss is
the whole loss and each share's gradient reaches only the router that made it. The
census-free losses (per-microbatch, sequence, z) are defined over the whole microbatch's
tokens: each rank sums their counts and token totals over tp before forming its share
(`MoEFeedForward.token_group`, `pipeline.moe.router_losses`). With
``expert_tensor_parallel = tp`` the engine splits the experts over tp as well
(`pipeline.moe.expert_tensor_parallel`): their shards keep their own gradients.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.errors import PipelineConfigError
from pipeline.interop.hf_modules_tp import (
    ParallelEmbedding,
    ParallelLMHead,
    Region,
    SequenceSwitch,
    VocabSlot,
    enter_on_call,
    vocab_logits,
)
from pipeline.interop.hf_moe_families import LATENT_ATTENTION
from pipeline.interop.hf_moe_modules import MoEBlock, MoEHead
from pipeline.interop.hf_overlap import fuse_columns_on_call
from pipeline.interop.hf_tp_split import (
    column_names,
    split_attention,
    split_latent_attention,
    split_mlp,
)
from pipeline.model.layer_rng import tensor_parallel_rank_stream
from pipeline.moe.layer import MoEFeedForward
from pipeline.parallel.param_marks import is_tensor_parallel
from pipeline.parallel.tensor.collectives import (
    reduce_from_tensor_parallel_region,
    tp_rank_and_size,
)
from pipeline.parallel.tensor.sequence import (
    SEQUENCE_DIM,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    split_sequence,
    sum_gradient_over_tensor_parallel,
)

__all__ = ["TENSOR_PARALLEL_MOE", "ParallelMoEBlock", "ParallelMoEHead", "dense_ffn_width",
           "moe_tensor_parallel_problem", "parallel_moe_block", "parallel_tied_moe_head"]

TENSOR_PARALLEL_MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")
"""The MoE families `tensor_parallel_hf` splits (each checked against HF at pp2 × tp2 × ep2)."""

_NOT_SPLIT = {"olmoe": "its q_norm / k_norm normalise over all heads at once, which tp would "
                       "split between ranks"}


def dense_ffn_width(config: Any) -> int | None:
    """The width of the dense MLPs tp splits (None: every layer is MoE; the experts stay
    whole at expert tensor parallelism 1, so their width need not divide)."""
    if config.model_type in LATENT_ATTENTION:  # DeepSeek-V2 / V3
        return int(config.intermediate_size) if config.first_k_dense_replace > 0 else None
    dense = bool(getattr(config, "mlp_only_layers", None)) or \
        int(getattr(config, "decoder_sparse_step", 1) or 1) > 1
    return int(config.intermediate_size) if dense else None


def moe_tensor_parallel_problem(hf: Any, overlap: bool) -> str | None:
    """Why `tensor_parallel_hf` would not split `layers_from_hf`'s MoE model `hf` exactly
    (None: it does)."""
    model_type = hf.config.model_type
    if model_type not in TENSOR_PARALLEL_MOE:
        reason = _NOT_SPLIT.get(model_type, "it is not mapped")
        return (f"tensor_parallel_hf splits the MoE families {', '.join(TENSOR_PARALLEL_MOE)}, "
                f"not {model_type!r} ({reason}) yet; train it at tensor_parallel=1 "
                "(expert_parallel splits its experts)")
    if overlap:
        return (f"tensor_parallel_hf(overlap=True) is not wired for {model_type}'s MoE "
                "blocks yet; use overlap=False")
    return None


class ParallelMoEBlock(SequenceSwitch, MoEBlock):
    """`MoEBlock` whose attention (and dense MLP) was split over tp and whose MoE layer runs
    this tp rank's 1/t of the tokens (module docstring)."""

    def __init__(self, block: MoEBlock, region: Region) -> None:
        super().__init__(block.layer, block.config, block.mask_function, block.rotary)
        self.region = region
        self.rank, self.size = tp_rank_and_size(region.group)
        moe = getattr(block.layer, "mlp", None)
        if isinstance(moe, MoEFeedForward):  # its per-microbatch losses see 1/t of the tokens
            moe.token_group = region.group

    def forward(self, value: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, balance, positions, *rest = value
        attention_mask = rest[0] if rest else None
        sliced = self.region.splits_sequence
        whole = hidden[:, :1].expand(hidden.shape[0], hidden.shape[SEQUENCE_DIM] * self.size,
                                     hidden.shape[-1]) if sliced else hidden
        mask = self.mask_function(self.config, whole, attention_mask, None, positions)
        layer: Any = self.layer
        # this rank's tokens (and heads): dropout masks of their own, as Megatron's
        stream = tensor_parallel_rank_stream(self.rank) if sliced else contextlib.nullcontext()
        with stream:
            attended, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden),
                                          position_embeddings=self.rotary(whole, positions),
                                          attention_mask=mask, position_ids=positions)
            hidden = hidden + attended
            normed = layer.post_attention_layernorm(hidden)
            if isinstance(layer.mlp, MoEFeedForward):
                mixed, share = self._experts(layer.mlp, normed, attention_mask)
                balance = balance + share
            else:
                mixed = layer.mlp(normed)
        return (hidden + mixed, balance, positions, *rest)

    def _experts(self, moe: MoEFeedForward, normed: torch.Tensor,
                 attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        group = self.region.group
        # here, not at build: expert parallelism swaps the expert tensors for new shard
        # parameters after the build (registering twice is a no-op); experts split over tp
        # (expert_tensor_parallel = tp) keep their shard's own gradient
        for param in moe.parameters():
            if not is_tensor_parallel(param):
                sum_gradient_over_tensor_parallel(param, group)
        sliced = self.region.splits_sequence
        if not sliced and normed.shape[SEQUENCE_DIM] % self.size:
            raise PipelineConfigError(
                f"sequence length {normed.shape[SEQUENCE_DIM]} is not divisible by "
                f"tensor_parallel={self.size}: each tp rank routes its 1/t of the sequence to "
                "the experts; pad or cut batches to a multiple of tp")
        tokens = normed if sliced else scatter_to_sequence_parallel_region(normed, group)
        mine = None if attention_mask is None else split_sequence(
            attention_mask, self.size, self.rank)
        mixed, share = moe(tokens, mine)
        if not sliced:  # every rank's consumer holds the whole gradient: keep own slice
            mixed = gather_from_sequence_parallel_region(mixed, group, reduce_grads=False)
        return mixed, share


def parallel_moe_block(block: MoEBlock, config: Any, region: Region) -> ParallelMoEBlock:
    """Split a built MoE decoder layer's attention (multi-head latent attention by heads,
    `split_latent_attention`) and dense MLP over ``region.group``; its MoE layer stays
    whole (the engine's expert parallelism slices the experts)."""
    rank, size = tp_rank_and_size(region.group)
    layer: Any = block.layer
    attention = layer.self_attn
    split = [attention]
    if config.model_type in LATENT_ATTENTION:  # its low-rank q / kv inputs are replicated
        split_latent_attention(attention, config, region)
        enter_on_call(attention, region)
    else:
        split_attention(attention, config, region, rank, size)
        _enter(attention, region)
    if not isinstance(layer.mlp, MoEFeedForward):  # a dense layer (DeepSeek's first ones)
        split_mlp(layer.mlp, region)
        _enter(layer.mlp, region)
        split.append(layer.mlp)
    if region.sequence_parallel:  # norms see 1/t of the tokens
        inside = {id(p) for part in split for p in part.parameters()}
        for param in layer.parameters():
            if id(param) not in inside:
                sum_gradient_over_tensor_parallel(param, region.group)
    return ParallelMoEBlock(block, region)


def _enter(module: nn.Module, region: Region) -> None:
    if region.runs_overlap_functions:  # one fused column GEMM per module (q;k;v, gate;up)
        fuse_columns_on_call(module, column_names(module), region)
    else:
        enter_on_call(module, region)


class ParallelMoEHead(MoEHead):
    """The untied head split by vocabulary rows; the carried balancing loss summed over tp
    (each rank's covers its own tokens)."""

    def __init__(self, head: MoEHead, region: Region, slot: VocabSlot) -> None:
        super().__init__(ParallelLMHead(head.head, region, slot))
        self.region = region

    def forward(self, value: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head(value[0]), reduce_from_tensor_parallel_region(value[1],
                                                                       self.region.group)


def parallel_tied_moe_head(module: nn.Module, value: tuple[torch.Tensor, torch.Tensor], *,
                           slot: VocabSlot) -> tuple[torch.Tensor, torch.Tensor]:
    """The tied head: this rank's vocabulary slice of the embedding as the output weight,
    the balancing loss summed over tp (whole at tp 1)."""
    if not isinstance(module, ParallelEmbedding):
        weight: Any = module.weight
        return F.linear(value[0], weight), value[1]
    logits = vocab_logits(value[0], module.weight, module.region, slot, module.vocab_start)
    return logits, reduce_from_tensor_parallel_region(value[1], module.region.group)
