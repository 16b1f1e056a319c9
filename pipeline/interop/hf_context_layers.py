"""The pieces `context_parallel_hf` builds from, for dense and MoE families alike: the cp
slot, the embedding of the rank's chunks, the mask on global positions, the attention swap,
and the loss of the rank's targets (the layout: `pipeline.interop.hf_context_parallel`)."""

from __future__ import annotations

import copy
import dataclasses
import importlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from pipeline.errors import PipelineConfigError
from pipeline.interop.hf_modules import HFEmbedding
from pipeline.interop.hf_modules_tp import VocabSlot
from pipeline.interop.hf_shared import IGNORE_INDEX
from pipeline.model.build_context import current_process_groups
from pipeline.model.layers import LayerSpec
from pipeline.parallel.context.attention import (
    GROUP_ATTRIBUTE,
    RING_ATTRIBUTE,
    context_parallel_attention,
)
from pipeline.parallel.context.mask import PositionMask
from pipeline.parallel.context.sharding import (
    check_context_parallel_sequence,
    gathered_positions,
    rank_positions,
    shard_sequence,
)
from pipeline.parallel.tensor.vocab_cross_entropy import vocab_parallel_token_losses

__all__ = ["ATTENTION_NAME", "ContextEmbedding", "ContextMask", "ContextSlot", "built",
           "rank_count", "rank_loss_sum", "rank_targets", "swap_attention"]

ATTENTION_NAME = "pipesched_context_parallel"
"""The name `context_parallel_attention` is registered under in HF's AttentionInterface."""


@dataclasses.dataclass
class ContextSlot:
    """This rank's cp group, rank and size, filled while its layers are built (cp = 1, rank
    0 outside the engine): the loss reads it to slice the targets like the inputs."""

    group: ProcessGroup | None = None
    rank: int = 0
    size: int = 1

    def fill(self) -> None:
        groups = current_process_groups()
        if groups is not None and groups.cp_group is not None:
            self.group, self.rank, self.size = (groups.cp_group, groups.position.cp_rank,
                                                groups.topology.cp)


def _refuse_decoding(what: str) -> PipelineConfigError:
    return PipelineConfigError(f"{what}: decoding (a KV cache) does not run under context "
                               "parallelism; generate with the layers of layers_from_hf")


class ContextEmbedding(HFEmbedding):
    """The token embedding of this rank's two chunks: ``(hidden, global positions[, mask])``."""

    def __init__(self, embedding: nn.Module, slot: ContextSlot) -> None:
        super().__init__(embedding)
        self.slot = slot

    def forward(self, x: Any) -> tuple[torch.Tensor, ...]:
        parts = (x,) if isinstance(x, torch.Tensor) else tuple(x)
        if len(parts) > 2:
            raise _refuse_decoding("the embedding got position ids")
        ids, mask = (*parts, None)[:2]
        rank, size = self.slot.rank, self.slot.size
        check_context_parallel_sequence(ids.shape[1], size)
        hidden = self.embedding(shard_sequence(ids, rank, size))
        positions = rank_positions(ids.shape[1], rank, size, ids.device).unsqueeze(0)
        return (hidden, positions, *(() if mask is None else (mask,)))


@dataclasses.dataclass(frozen=True)
class ContextMask:
    """A block's mask function (HF's ``create_causal_mask`` signature): this rank's queries
    against every cp rank's keys, on global positions: a `PositionMask`, which the attention
    makes dense while it runs (`context_mask`) and keeps for the backward as positions."""

    slot: ContextSlot
    window: int | None

    def __call__(self, config: Any, hidden: torch.Tensor, attention_mask: Any, cache: Any,
                 positions: torch.Tensor) -> PositionMask:
        if cache is not None:
            raise _refuse_decoding("a block got a cache")
        length = positions.shape[-1] * self.slot.size
        keys = gathered_positions(length, self.slot.size, positions.device)
        return PositionMask(positions, keys, attention_mask, self.window)


def _register_attention() -> None:
    transformers = importlib.import_module("transformers")
    transformers.AttentionInterface.register(ATTENTION_NAME, context_parallel_attention)


def _from_model(original: LayerSpec) -> bool:
    return any(isinstance(arg, nn.Module) for arg in original.args)


def built(original: LayerSpec, slot: ContextSlot) -> nn.Module:
    """The plain layer (a copy when it is a given model's own module, which is changed)."""
    slot.fill()
    module = original.build()
    return copy.deepcopy(module) if _from_model(original) else module


def swap_attention(block: Any, slot: ContextSlot, ring: bool) -> None:
    """Run a built decoder block's (``block.layer.self_attn``, ``block.mask_function``,
    ``block.config``) attention over the cp group: HF's attention function swapped for
    `context_parallel_attention`, the mask function for `ContextMask`."""
    _register_attention()
    attention: Any = block.layer.self_attn
    config = copy.copy(attention.config)
    config._attn_implementation = ATTENTION_NAME
    attention.config = config
    setattr(attention, GROUP_ATTRIBUTE, slot.group)
    setattr(attention, RING_ATTRIBUTE, ring)
    masks = importlib.import_module("transformers.masking_utils")
    sliding = block.mask_function is masks.create_sliding_window_causal_mask
    block.mask_function = ContextMask(slot, block.config.sliding_window if sliding else None)


def rank_targets(slot: ContextSlot, labels: torch.Tensor) -> torch.Tensor:
    """Token t predicts label t+1 on the whole sequence; then this rank's chunks of it."""
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    return shard_sequence(shifted, slot.rank, slot.size)


def rank_loss_sum(slot: ContextSlot, vocab: VocabSlot | None, logits: torch.Tensor,
                  labels: torch.Tensor) -> torch.Tensor:
    """Summed cross entropy of this rank's tokens; vocab-parallel when the logits are this tp
    rank's vocabulary slice (`tensor_parallel_hf`'s head, `vocab`)."""
    targets = rank_targets(slot, labels)
    if vocab is not None and vocab.group is not None:
        return vocab_parallel_token_losses(logits, targets, vocab.vocab_start, vocab.group,
                                           IGNORE_INDEX)[0].sum()
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def rank_count(slot: ContextSlot, labels: torch.Tensor) -> torch.Tensor:
    """This rank's target tokens (not `IGNORE_INDEX`): the loss's count."""
    return (rank_targets(slot, labels) != IGNORE_INDEX).sum()
