"""Counted memory of a HF model split over tp in pipeline stages against the accounting's
prediction (test and benchmark helper): model states after an Adam step, and the activation
bytes one decoder layer keeps, per rank."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pipeline import PipelineEngine, PipelineModule
from pipeline.interop.hf_layers import causal_lm_targets, layers_from_hf
from pipeline.interop.hf_tensor_parallel import tensor_parallel_hf
from pipeline.parallel.model_state import count_model_states
from pipeline.parallel.tensor.sequence import split_sequence
from pipeline.planner.hf_config import shape_from_hf_config
from pipeline.planner.transformer import TransformerShape
from pipeline.planner.transformer_layers import transformer_profile
from pipeline.runtime.saved_memory import SavedTensorMeter
from schedules.analysis.accounting import layer_activation_bytes, model_state_bytes
from schedules.analysis.eager_activations import eager_layer_activation_bytes
from tests.support.hf_models import tiny_config, token_batch

__all__ = ["MEMORY_FAMILIES", "activation_rows", "memory_rows", "predicted_layer_params"]

MEMORY_FAMILIES = ("llama", "gpt2")
"""A grouped-query Llama (4 heads, 2 kv heads) and GPT-2 (fused c_attn, tied embeddings)."""
SEQ, BATCH = 16, 2
MLP_TENSORS = {"llama": 4, "gpt2": 5}
"""Tensors of s·b·f/t the MLP keeps: SwiGLU 4; GPT-2's python gelu_new 5
(`schedules.analysis.eager_activations`)."""


def predicted_layer_params(shape: TransformerShape, config: Any, tp: int,
                           head_copy: bool) -> list[float]:
    """Parameters one tp rank holds per layer of `layers_from_hf`'s list, from the planner's
    profile (`transformer_profile`): its embedding is the token table (split) and GPT-2's
    positions (replicated), its head the final norm (replicated) and the projection (split;
    tied: a copy where `head_copy`, the head on another rank than the embedding)."""
    profile = transformer_profile(shape, "fp32")
    embedding, *blocks, head = profile.layers
    layers = [embedding.params_split / tp]
    if config.model_type == "gpt2":
        layers.append(embedding.params_replicated)
    layers += [block.params(tp) for block in blocks]
    projection = head.params_split + (head.tied_params_split if head_copy else 0.0)
    return [*layers, head.params_replicated, projection / tp]


def memory_rows(sequence_parallel: bool = True) -> list[dict[str, Any]]:
    """On every rank of pp 2 × dp 2 × tp 2 (8 ranks), per family and ZeRO stage: the model
    states `count_model_states` finds after one Adam step, and the prediction (the rank's
    stage's parameters, `predicted_layer_params`, × `model_state_bytes`); then, over the
    rank's tp group, `activation_rows` (one launch for both: start-up is the cost)."""
    torch.set_num_threads(1)
    rows = []
    for family in MEMORY_FAMILIES:
        config = tiny_config(family)
        hf = tensor_parallel_hf(layers_from_hf(config), sequence_parallel=sequence_parallel)
        shape = shape_from_hf_config(config.to_dict(), seq=SEQ)
        for zero in (0, 1):
            module = PipelineModule(hf.layers, num_stages=2, loss_fn=hf.loss_fn,
                                    partition_method="uniform")
            engine = PipelineEngine(module, num_microbatches=2, tensor_parallel=2,
                                    data_parallel=2, zero_stage=zero, timeout=60,
                                    optimizer=lambda p: torch.optim.Adam(p, lr=1e-3))
            ids, _ = token_batch(2 * BATCH, SEQ, seed=2)
            engine.train_batch(ids, causal_lm_targets(ids))
            counted = count_model_states(module, engine.optimizer)
            bounds = module.boundaries
            head_stage = next(k for k in range(len(bounds) - 1)
                              if bounds[k] <= len(hf.layers) - 1 < bounds[k + 1])
            per_layer = predicted_layer_params(shape, config, 2, head_copy=head_stage != 0)
            stage = engine.position.pp_rank
            params = sum(per_layer[bounds[stage]:bounds[stage + 1]])
            states = model_state_bytes("fp32", zero_stage=zero, data_parallel=2)
            rows.append({"kind": "states", "family": family, "zero": zero, "rank": dist.get_rank(),
                         "stage": stage, "counted": counted.total,
                         "predicted": params * states.total,
                         "counted_params": counted.num_parameters,
                         "predicted_params": params})
            engine.stop_watchdog()
            group = engine.groups.tp_group if engine.groups is not None else None
    return rows + activation_rows(group)


def activation_rows(group: Any = None) -> list[dict[str, Any]]:
    """On every rank of a tp group of 2 (`group`; None: the world): the bytes autograd saves
    (`SavedTensorMeter`) for one decoder layer of each family split over tp, with and without
    sequence parallelism, against `eager_layer_activation_bytes` and, for contrast,
    Korthikanti's `layer_activation_bytes` (Megatron's kernels, fused attention, no dropout,
    at 4 bytes an element)."""
    torch.set_num_threads(1)
    group = dist.group.WORLD if group is None else group
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    rows = []
    for family in MEMORY_FAMILIES:
        config = tiny_config(family)
        shape = shape_from_hf_config(config.to_dict(), seq=SEQ)
        for sequence_parallel in (False, True):
            hf = tensor_parallel_hf(layers_from_hf(config),
                                    sequence_parallel=sequence_parallel)
            spec = hf.layers[2 if family == "gpt2" else 1]
            torch.manual_seed(0)
            block = spec.typename(*spec.args, group=group)
            hidden = torch.randn(BATCH, SEQ, shape.hidden)
            if sequence_parallel:
                hidden = split_sequence(hidden, size, rank)
            hidden.requires_grad_()
            positions = torch.arange(SEQ).expand(BATCH, SEQ)
            with SavedTensorMeter(ignore=list(block.parameters())) as meter:
                kept = block((hidden, positions))  # its graph holds the saved tensors
            counted = meter.live
            del kept
            predicted = eager_layer_activation_bytes(
                SEQ, BATCH, shape.hidden, shape.heads, q_width=shape.q_width,
                kv_width=shape.kv_width, ffn=shape.ffn, head_dim=shape.head_dim,
                norm="layernorm" if family == "gpt2" else "rmsnorm",
                rotary=family != "gpt2", mlp_tensors=MLP_TENSORS[family], t=size,
                sequence_parallel=sequence_parallel)
            korthikanti = 2 * layer_activation_bytes(
                SEQ, BATCH, shape.hidden, shape.heads, attention="fused", t=size,
                sequence_parallel=sequence_parallel, dropout_mask_bytes=0, ffn=shape.ffn,
                kv_width=shape.kv_width)
            rows.append({"kind": "activations", "family": family,
                         "sequence_parallel": sequence_parallel,
                         "rank": rank, "counted": counted, "predicted": predicted,
                         "korthikanti": korthikanti})
    return rows
