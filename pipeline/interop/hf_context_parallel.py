"""`context_parallel_hf(hf)`: the context-parallel form of a `layers_from_hf` model.

In the shape of `tensor_parallel_hf`: one function takes the layers and returns them
parallelised; each factory finds the rank's cp group while it builds
(`pipeline.model.build_context.current_process_groups`). Every cp rank of a replica is
given the same batch; each keeps its two of the sequence's 2·cp chunks (causal load
balancing, `pipeline.parallel.context.sharding`):

    embedding   keeps the rank's chunks of input_ids; carries their global positions (rotary
                needs them) and the whole sequence's padding mask (for the keys)
    attention   HF's decoder layer as is, its attention function replaced by
                `context_parallel_attention`: keys and values all-gathered over cp (backward:
                reduce-scatter), the causal / sliding-window / padding mask on global positions
    norm, MLP,  per token: on the rank's slice, unchanged
    head
    loss        targets shifted on the whole sequence, then sliced like the inputs: summed
                cross entropy with its count, so the engine divides by the step's global
                token count (over microbatches, dp and cp: `loss_normalization`)

Gradients of the (replicated) parameters are averaged over dp × cp by the engine's reducer.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from pipeline.errors import PipelineConfigError
from pipeline.interop.hf_layers import (
    IGNORE_INDEX,
    HFBlock,
    HFEmbedding,
    HFLayers,
    _block,
    _final_norm,
    _lm_head,
)
from pipeline.interop.hf_modules_tp import VocabSlot
from pipeline.interop.hf_tensor_parallel import _block as tp_block
from pipeline.interop.hf_tensor_parallel import _head as tp_head
from pipeline.interop.hf_tensor_parallel import _replicated as tp_replicated
from pipeline.interop.hf_tp_losses import summed_loss as tp_summed_loss
from pipeline.model.build_context import current_process_groups
from pipeline.model.layers import Layer, LayerSpec
from pipeline.model.tied import TiedLayerSpec
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
from pipeline.runtime.loss_normalization import SummedLoss
from pipeline.runtime.whole_vocabulary import vocab_parallel_loss

__all__ = ["ATTENTION_NAME", "COVERED", "ContextEmbedding", "ContextMask", "ContextSlot",
           "context_parallel_hf"]

COVERED = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text")
"""Model types whose attention is HF's Llama-shaped attention module (rotary, GQA, sliding
window by config or layer type, no attention-logit soft-capping): only its attention
function is swapped."""
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


def _built(original: LayerSpec, slot: ContextSlot) -> nn.Module:
    """The plain layer (a copy when it is a given model's own module, which is changed)."""
    slot.fill()
    module = original.build()
    return copy.deepcopy(module) if _from_model(original) else module


def _embedding(original: LayerSpec, slot: ContextSlot) -> nn.Module:
    built = _built(original, slot)
    assert isinstance(built, HFEmbedding)
    return ContextEmbedding(built.embedding, slot)


def _context_block(original: LayerSpec, slot: ContextSlot, ring: bool = False) -> nn.Module:
    block = _built(original, slot)
    assert isinstance(block, HFBlock)
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
    return block


def _per_token(original: LayerSpec, slot: ContextSlot) -> nn.Module:
    """The final norm and the head: per token, the rank's slice as it is."""
    return _built(original, slot)


def _rank_targets(slot: ContextSlot, labels: torch.Tensor) -> torch.Tensor:
    """Token t predicts label t+1 on the whole sequence; then this rank's chunks of it."""
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    return shard_sequence(shifted, slot.rank, slot.size)


def _loss_sum(slot: ContextSlot, vocab: VocabSlot | None, logits: torch.Tensor,
              labels: torch.Tensor) -> torch.Tensor:
    """Summed cross entropy of this rank's tokens; vocab-parallel when the logits are this tp
    rank's vocabulary slice (`tensor_parallel_hf`'s head, `vocab`)."""
    targets = _rank_targets(slot, labels)
    if vocab is not None and vocab.group is not None:
        return vocab_parallel_token_losses(logits, targets, vocab.vocab_start, vocab.group,
                                           IGNORE_INDEX)[0].sum()
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def _count(slot: ContextSlot, labels: torch.Tensor) -> torch.Tensor:
    return (_rank_targets(slot, labels) != IGNORE_INDEX).sum()


def _check_covered(hf: HFLayers) -> None:
    kind = hf.config.model_type
    if kind not in COVERED:
        raise PipelineConfigError(
            f"context_parallel_hf covers model types {', '.join(COVERED)}; got {kind!r} "
            "(its attention or positions are not the Llama shape this swaps into): train it "
            "with context_parallel=1")
    if getattr(hf.config, "use_bidirectional_attention", False) or getattr(
            hf.config, "attn_logit_softcapping", None) is not None:
        raise PipelineConfigError(
            f"context_parallel_hf builds causal masks and plain softmax attention; {kind!r} "
            "with use_bidirectional_attention=True or attn_logit_softcapping set is not "
            "covered: use context_parallel=1")
    if any(isinstance(layer, TiedLayerSpec) for layer in hf.layers):
        raise PipelineConfigError(
            f"context_parallel_hf does not cover tied input and output embeddings yet "
            f"({kind!r} with tie_word_embeddings=True); untie them or use context_parallel=1")
    plain = [_block] * (len(hf.layers) - 3) + [_final_norm, _lm_head]
    split = [tp_block] * (len(hf.layers) - 3) + [tp_replicated, tp_head]
    found = [getattr(layer, "typename", None) for layer in hf.layers[1:]]
    if found not in (plain, split) or not isinstance(hf.layers[0], LayerSpec):
        raise PipelineConfigError(
            "context_parallel_hf needs the layers of layers_from_hf, or of tensor_parallel_hf "
            "over them, unchanged (embedding, blocks, norm, head as specs); apply it last")


def _vocab_slot(hf: HFLayers) -> VocabSlot | None:
    """`tensor_parallel_hf`'s vocabulary slot (filled by its head as it builds), if `hf`
    is its result: the loss is then vocab-parallel."""
    loss_sum = getattr(hf.summed_loss, "loss_sum", None)
    if isinstance(loss_sum, functools.partial) and loss_sum.func is tp_summed_loss:
        slot: VocabSlot = loss_sum.args[0].slot
        return slot
    return None


def context_parallel_hf(hf: HFLayers, *, attention: Literal["all-gather", "ring"] = "all-gather"
                        ) -> HFLayers:
    """`hf` with each sequence split over the cp group its layers are built with (cp = 1,
    as in the single-process reference: HF's result on the whole sequence); `hf` may be
    `tensor_parallel_hf`'s result (cp outside tp: the tp-split attention's local heads
    gather their keys and values over cp, the loss stays vocab-parallel). Train with
    ``PipelineEngine(PipelineModule(cp_hf.layers, loss_fn=cp_hf.loss_fn, ...),
    context_parallel=c)``, every cp rank of a replica passing the same batch, whose length
    must be a multiple of 2·c (`check_context_parallel_sequence`). Both `loss_fn` and
    `summed_loss` are the summed token cross entropy: the engine normalises it by the
    step's global token count, which is HF's mean over the batch. `attention`: "all-gather"
    (keys and values gathered over cp, Llama 3's choice) or "ring" (passed round the cp
    group, merged by an online softmax; `pipeline.parallel.context.ring`)."""
    if attention not in ("all-gather", "ring"):
        raise PipelineConfigError(f"attention must be 'all-gather' or 'ring', got "
                                  f"{attention!r}")
    _check_covered(hf)
    slot = ContextSlot()
    layers: list[Layer] = []
    for index, layer in enumerate(hf.layers):
        assert isinstance(layer, LayerSpec)
        if 0 < index < len(hf.layers) - 2:
            layers.append(LayerSpec(_context_block, layer, slot, attention == "ring"))
        else:
            layers.append(LayerSpec(_embedding if index == 0 else _per_token, layer, slot))
    vocab = _vocab_slot(hf)
    summed = SummedLoss(functools.partial(_loss_sum, slot, vocab),
                        functools.partial(_count, slot),
                        "context-parallel token cross entropy, ignore_index=-100, shifted")
    if vocab is not None:  # over tp it reads its rank's vocabulary slice, as tp's own loss
        summed = vocab_parallel_loss(summed)
    return dataclasses.replace(hf, layers=layers, loss_fn=summed, summed_loss=summed)
