"""`tensor_parallel_hf(hf)`: the tensor-parallel form of a `layers_from_hf` model.

As torchtitan's ``parallelize_llama``, one function takes the model and returns it
parallelised; nothing is threaded through the engine. Every layer becomes a spec whose
factory receives the rank's tp group at build time (`pipeline.model.build_context`), builds
the plain layer with the same seed, and keeps this rank's slice (Megatron, Shoeybi et al.
2019 §3; Korthikanti et al. 2022 for sequence parallelism):

    embedding   vocabulary rows split; the parts summed (g) / reduce-scattered (SP)
    attention   q (k, v) rows split by heads; key/value heads split when tp divides them,
                else held whole and each rank uses its query heads' kv head (as vLLM and
                Megatron-Core with fewer query groups than tp); o_proj split by columns
    MLP         gate, up (Phi-3's fused gate_up, GPT-2's c_fc) by rows; down by columns
    GPT-2       the fused c_attn Conv1D cut per Q / K / V block, by heads
    head        vocabulary rows split (tied: the embedding's own slice); logits stay split
    loss        vocab-parallel cross entropy: three per-token all-reduces, no gathered logits
    norms       whole on every rank; with sequence parallelism each sees 1/t of the tokens
                and its gradient is summed over tp (so are Qwen3's / Gemma 3's per-head
                q_norm / k_norm, which see 1/t of the heads)
    overlap     (``overlap=True``) each block's column-parallel projections fused into one
                GEMM per module (q;k;v, gate;up: `hf_overlap`) and its row-parallel ones run
                by `pipeline.parallel.tensor.overlap`, collectives beside the GEMMs, as the
                engine's own `ParallelTransformerBlock(overlap=True)` (embedding and head
                as without); with sequence parallelism the same functions without overlap
                (their sequential baseline), so the column layers keep their input's slice

Why our Megatron-style autograd operators and not DTensor's ``parallelize_module``
(`pipeline.parallel.tensor.collectives` has the whole case; re-checked on torch 2.13, gloo,
CPU: a Linear pair under Colwise/RowwiseParallel returns an ``AsyncCollectiveTensor`` and
its gradients are DTensors whose ``torch.cat`` is the full 76-element tensor where each
rank holds 40): the engine's flat ZeRO-1 and bucket buffers would hold unsharded
gradients, P2P sends need plain completed tensors, and tied embeddings across stages and
sliced loads are one slice each with plain tensors. HF modules are reused, not
rewritten: projections are swapped for slices under the same names, so loading, exporting
and checkpoints map by HF name, and soft-capping, sliding windows and rotary stay HF's.
"""

from __future__ import annotations

import dataclasses
import functools

from pipeline.errors import PipelineConfigError
from pipeline.interop.hf_layers import HFLayers
from pipeline.interop.hf_modules_tp import VocabSlot
from pipeline.interop.hf_moe_families import COVERED_MOE
from pipeline.interop.hf_moe_tp import moe_tensor_parallel_problem, parallel_tied_moe_head
from pipeline.interop.hf_tp_layers import (
    _block,
    _embedding,
    _head,
    _moe_block,
    _moe_embedding,
    _moe_head,
    _parallel_tied_head,
    _replicated,
    _untied_embedding,
)
from pipeline.interop.hf_tp_losses import (
    BalancedVocabSummedLoss,
    TensorParallelPlan,
    count_targets,
    mean_loss,
    moe_mean_loss,
    summed_loss,
)
from pipeline.interop.hf_tp_sizes import check_tensor_parallel_size, valid_tensor_parallel_sizes
from pipeline.model.layers import Layer, LayerSpec
from pipeline.model.tied import TiedLayerSpec
from pipeline.parallel.tensor.overlap import REAL_OPS, TensorParallelOps
from pipeline.runtime.loss_normalization import SummedLoss
from pipeline.runtime.whole_vocabulary import vocab_parallel_loss

__all__ = ["check_tensor_parallel_size", "tensor_parallel_hf", "valid_tensor_parallel_sizes"]


# -- the transform ---------------------------------------------------------------------------

def tensor_parallel_hf(hf: HFLayers, *, sequence_parallel: bool = False,
                       overlap: bool = False, overlap_chunks: int = 2,
                       ops: TensorParallelOps = REAL_OPS,
                       shift_labels: bool = True) -> HFLayers:
    """`hf` with every layer split over the tp group it is built with (tp = 1, as in the
    single-process reference: the plain layers). Train with
    ``PipelineEngine(PipelineModule(tp_hf.layers, ...), tensor_parallel=t)``; the loss is
    the vocab-parallel cross entropy. `sequence_parallel` keeps 1/t of the sequence between
    the tp regions (batches' lengths must divide by t). `overlap` runs each block's tp
    collectives beside its GEMMs (Megatron-Core's ``--tp-comm-overlap``; the engine's own
    layers' `overlap`, `overlap_chunks` their `chunks`; `pipesched plan --tp-comm-overlap`
    prices it); `ops` is the GEMM / collective seam emulated devices replace.
    `shift_labels=False`: targets come shifted already, token t predicts target t (the
    packed windows `pipesched run` reads from a token file), not HF's label t+1."""
    moe = hf.config.model_type in COVERED_MOE
    problem = moe_tensor_parallel_problem(hf, overlap) if moe else None
    if problem is not None:
        raise PipelineConfigError(problem)
    if not isinstance(overlap, bool):
        raise PipelineConfigError(f"overlap must be True or False, got {overlap!r}")
    if isinstance(overlap_chunks, bool) or not isinstance(overlap_chunks, int) \
            or overlap_chunks < 1:
        raise PipelineConfigError(f"overlap_chunks must be an int >= 1 (the slices each "
                                  f"overlapped collective is cut in), got {overlap_chunks!r}")
    plan = TensorParallelPlan(hf.config, sequence_parallel, VocabSlot(), overlap,
                              overlap_chunks, ops, shift_labels)
    gpt2 = hf.config.model_type == "gpt2"
    first_block = 2 if gpt2 else 1
    last_block = len(hf.layers) - 3
    layers: list[Layer] = []
    for index, layer in enumerate(hf.layers):
        if isinstance(layer, TiedLayerSpec):  # embedding and tied head: one module, sliced
            head = index == len(hf.layers) - 1
            forward_fn = functools.partial(parallel_tied_moe_head, slot=plan.slot) \
                if head and moe else functools.partial(
                _parallel_tied_head, plan=plan,
                softcap=getattr(hf.config, "final_logit_softcapping", None)) if head \
                else layer.forward_fn
            layers.append(TiedLayerSpec(layer.key, _embedding, layer.cls, plan,
                                        forward_fn=forward_fn))
            continue
        if not isinstance(layer, LayerSpec):
            raise TypeError(f"layer {index} of the HF layers is {type(layer).__name__}, not a "
                            "spec; pass layers_from_hf's result unchanged")
        if index == 0:
            layers.append(LayerSpec(_moe_embedding, layer, plan) if moe
                          else LayerSpec(_untied_embedding, layer.args[0], plan))
        elif first_block <= index <= last_block:
            layers.append(LayerSpec(_moe_block if moe else _block, layer, plan))
        elif index == len(hf.layers) - 1:
            layers.append(LayerSpec(_moe_head if moe else _head, layer, plan))
        else:  # GPT-2's positions, the final norm
            layers.append(LayerSpec(_replicated, layer, plan))
    name = "vocab-parallel token cross entropy, ignore_index=-100" + (
        ", shifted" if shift_labels else "")
    summed = (BalancedVocabSummedLoss if moe else SummedLoss)(
        functools.partial(summed_loss, plan), functools.partial(count_targets, plan),
        name + (" + balancing loss" if moe else ""))
    mean = functools.partial(moe_mean_loss if moe else mean_loss, plan)
    # both take the vocabulary slices: the engine passes them ungathered (a user's own loss
    # gets the gathered logits, `pipeline.runtime.whole_vocabulary`)
    return dataclasses.replace(hf, layers=layers, loss_fn=vocab_parallel_loss(mean),
                               summed_loss=vocab_parallel_loss(summed))
