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
Mixture-of-experts families: `pipeline.interop.hf_moe_context` (each cp rank routes its own
tokens; expert parallelism carved from dp × cp).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

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
from pipeline.interop.hf_layers import HFLayers, _block, _final_norm, _lm_head
from pipeline.interop.hf_modules import HFBlock, HFEmbedding
from pipeline.interop.hf_modules_tp import VocabSlot
from pipeline.interop.hf_moe_context import context_parallel_moe, is_moe
from pipeline.interop.hf_tp_layers import _block as tp_block
from pipeline.interop.hf_tp_layers import _head as tp_head
from pipeline.interop.hf_tp_layers import _replicated as tp_replicated
from pipeline.interop.hf_tp_losses import summed_loss as tp_summed_loss
from pipeline.model.layers import Layer, LayerSpec
from pipeline.model.tied import TiedLayerSpec
from pipeline.runtime.loss_normalization import SummedLoss
from pipeline.runtime.whole_vocabulary import vocab_parallel_loss

__all__ = ["COVERED", "context_parallel_hf"]

COVERED = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text")
"""Model types whose attention is HF's Llama-shaped attention module (rotary, GQA, sliding
window by config or layer type, no attention-logit soft-capping): only its attention
function is swapped."""


def _embedding(original: LayerSpec, slot: ContextSlot) -> nn.Module:
    embedding = built(original, slot)
    assert isinstance(embedding, HFEmbedding)
    return ContextEmbedding(embedding.embedding, slot)


def _context_block(original: LayerSpec, slot: ContextSlot, ring: bool = False) -> nn.Module:
    block = built(original, slot)
    assert isinstance(block, HFBlock)
    swap_attention(block, slot, ring)
    return block


def _per_token(original: LayerSpec, slot: ContextSlot) -> nn.Module:
    """The final norm and the head: per token, the rank's slice as it is."""
    return built(original, slot)


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
    group, merged by an online softmax; `pipeline.parallel.context.ring`). A mixture-of-
    experts `hf` (Mixtral, Qwen2-MoE, Qwen3-MoE; `pipeline.interop.hf_moe_context`): each
    cp rank routes its own tokens, over the ep group the engine carves from dp × cp."""
    if attention not in ("all-gather", "ring"):
        raise PipelineConfigError(f"attention must be 'all-gather' or 'ring', got "
                                  f"{attention!r}")
    if is_moe(hf):
        return context_parallel_moe(hf, ring=attention == "ring")
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
    summed = SummedLoss(functools.partial(rank_loss_sum, slot, vocab),
                        functools.partial(rank_count, slot),
                        "context-parallel token cross entropy, ignore_index=-100, shifted")
    if vocab is not None:  # over tp it reads its rank's vocabulary slice, as tp's own loss
        summed = vocab_parallel_loss(summed)
    return dataclasses.replace(hf, layers=layers, loss_fn=summed, summed_loss=summed)
