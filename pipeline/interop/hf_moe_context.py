"""Context parallelism for HF mixture-of-experts families: attention over the cp group, each cp
rank routing its own tokens to the experts.

As Megatron-Core composes cp with MoE. Legend: c = cp, e = ep, d = dp; the carried value is
``(hidden, balance, positions[, mask])`` (`pipeline.interop.hf_moe_modules`)::

    embedding   the rank's two chunks of input_ids (`hf_context_layers.ContextEmbedding`),
                balance 0, global positions, the whole sequence's padding mask (for keys)
    attention   as for the dense families: keys and values gathered (or ringed) over cp
    MoE         routes the rank's own tokens (its chunks of the padding mask); dispatched
                over the ep group, which the engine carves from the stage's d × c ranks:
                ep consecutive of them in rank order (dp-major, cp-minor; `Topology.ep_group`)
                -- at d = 1, c = e the all-to-all runs between the cp ranks of a sequence.
                Expert gradients: averaged over the d·c/e ranks holding the same experts
                (`Topology.expert_dp_group`), after the /e of `ExpertSplitReducer`
    balancing   HF's whole-batch census ("hf-batch") counts every rank's own tokens once (its
                all-reduce spans the world); the per-microbatch losses ("microbatch",
                "sequence", z-loss) sum their expert and token counts over the cp group
                (`MoEFeedForward.token_group`), so each rank's share is its tokens' part
                of the whole microbatch's loss
    loss        summed cross entropy of the rank's shifted targets, plus c × the carried
                balance: the shares of the c ranks add up to the sequence's balancing loss,
                and the reducer averages gradients over d × c as the cross entropy's
                m·d·c / N scale expects (`pipeline.runtime.loss_normalization`)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from pipeline.errors import PipelineConfigError
from pipeline.interop.hf_context_layers import (
    ContextEmbedding,
    ContextSlot,
    built,
    rank_count,
    rank_loss_sum,
    swap_attention,
)
from pipeline.interop.hf_moe import (
    MOE_FAMILIES,
    _block,
    _final_norm,
    _lm_head,
    _untied_embedding,
)
from pipeline.interop.hf_moe_modules import MoEBlock, MoEEmbedding, _with_balance
from pipeline.interop.hf_shared import HFLayers
from pipeline.model.layers import Layer, LayerSpec
from pipeline.model.tied import TiedLayerSpec
from pipeline.moe.layer import MoEFeedForward
from pipeline.parallel.context.sharding import shard_sequence
from pipeline.runtime.loss_normalization import SummedLoss

__all__ = ["CONTEXT_PARALLEL_MOE", "ContextBalancedLoss", "ContextMoEBlock",
           "ContextMoEEmbedding", "context_parallel_moe", "is_moe"]

CONTEXT_PARALLEL_MOE = ("mixtral", "qwen2_moe", "qwen3_moe")
"""The MoE families `context_parallel_hf` splits (Llama-shaped attention, softmax router)."""

_NOT_SPLIT = {
    "deepseek_v3": "its attention is multi-head latent attention, whose attention function "
                   "context parallelism does not swap yet",
    "olmoe": "it is not checked against HF under context parallelism yet",
}


def is_moe(hf: HFLayers) -> bool:
    """Whether `hf` is `layers_from_hf`'s result for a mixture-of-experts family."""
    return hf.config.model_type in MOE_FAMILIES


class ContextMoEEmbedding(ContextEmbedding):
    """The embedding of the rank's chunks, with the balancing loss's carried zero."""

    row_sums = (1,)
    """Position 1 of the carried tuple is the balancing loss (`MoEEmbedding.row_sums`)."""

    def forward(self, x: Any) -> tuple[torch.Tensor, ...]:
        return _with_balance(super().forward(x))


class ContextMoEBlock(MoEBlock):
    """`MoEBlock` whose attention runs over the cp group and whose MoE layer routes the
    rank's tokens, with their chunks of the padding mask."""

    def __init__(self, block: MoEBlock, slot: ContextSlot) -> None:
        super().__init__(block.layer, block.config, block.mask_function, block.rotary)
        self.slot = slot

    def routed_mask(self, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        if attention_mask is None:
            return None
        return shard_sequence(attention_mask, self.slot.rank, self.slot.size)


class ContextBalancedLoss(SummedLoss):
    """The rank's summed token cross entropy (scaled per step) plus cp × the carried
    balancing loss (module docstring)."""

    def __init__(self, slot: ContextSlot) -> None:
        super().__init__(functools.partial(rank_loss_sum, slot, None),
                         functools.partial(rank_count, slot),
                         "context-parallel token cross entropy, ignore_index=-100, shifted "
                         "+ balancing loss")
        self.slot = slot

    def __call__(self, outputs: Any, targets: Any) -> torch.Tensor:
        return self.loss_sum(outputs[0], targets) * self.scale \
            + outputs[1].sum() * self.slot.size


def _moe_embedding(original: LayerSpec, slot: ContextSlot) -> nn.Module:
    embedding = built(original, slot)
    assert isinstance(embedding, MoEEmbedding)
    return ContextMoEEmbedding(embedding.embedding, slot)


def _moe_block(original: LayerSpec, slot: ContextSlot, ring: bool) -> nn.Module:
    block = built(original, slot)
    assert isinstance(block, MoEBlock)
    swap_attention(block, slot, ring)
    for module in block.modules():
        if isinstance(module, MoEFeedForward):
            module.token_group = slot.group
    return ContextMoEBlock(block, slot)


def _per_token(original: LayerSpec, slot: ContextSlot) -> nn.Module:
    return built(original, slot)


def _check(hf: HFLayers) -> None:
    kind = hf.config.model_type
    if kind not in CONTEXT_PARALLEL_MOE:
        reason = _NOT_SPLIT.get(kind, "it is not mapped")
        raise PipelineConfigError(
            f"context_parallel_hf covers the mixture-of-experts families "
            f"{', '.join(CONTEXT_PARALLEL_MOE)}, not {kind!r} ({reason}); train it with "
            "context_parallel=1")
    if any(isinstance(layer, TiedLayerSpec) for layer in hf.layers):
        raise PipelineConfigError(
            f"context_parallel_hf does not cover tied input and output embeddings yet "
            f"({kind!r} with tie_word_embeddings=True); untie them or use context_parallel=1")
    plain = [_untied_embedding] + [_block] * (len(hf.layers) - 3) + [_final_norm, _lm_head]
    found = [getattr(layer, "typename", None) for layer in hf.layers]
    if found != plain:
        raise PipelineConfigError(
            f"context_parallel_hf needs {kind!r}'s layers as layers_from_hf gives them, "
            "unchanged (embedding, blocks, norm, head as specs); tensor_parallel_hf's MoE "
            "layers are not split over cp yet: use tensor_parallel=1 with context_parallel "
            "(expert_parallel splits the experts)")


def context_parallel_moe(hf: HFLayers, *, ring: bool = False) -> HFLayers:
    """`context_parallel_hf` for `layers_from_hf`'s MoE result `hf` (module docstring);
    `ring`: ring attention instead of the all-gather."""
    _check(hf)
    slot = ContextSlot()
    layers: list[Layer] = []
    last = len(hf.layers) - 1
    for index, layer in enumerate(hf.layers):
        assert isinstance(layer, LayerSpec)
        if index == 0:
            layers.append(LayerSpec(_moe_embedding, layer, slot))
        elif index < last - 1:
            layers.append(LayerSpec(_moe_block, layer, slot, ring))
        else:
            layers.append(LayerSpec(_per_token, layer, slot))
    summed = ContextBalancedLoss(slot)
    return dataclasses.replace(hf, layers=layers, loss_fn=summed, summed_loss=summed)
