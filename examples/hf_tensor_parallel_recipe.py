"""A tiny Llama split over tp for `pipesched train --model ...:build --tp 2` (no download),
with sequence parallelism and the tp collectives overlapped with the GEMMs, and each sequence
split over cp ranks with ``--cp``.

    pipesched train --model examples/hf_tensor_parallel_recipe.py:build --stages 2 --tp 2
    pipesched train --model examples/hf_tensor_parallel_recipe.py:build --stages 2 --cp 2
"""

from __future__ import annotations

import functools

import torch
import transformers

from pipeline.demo.user_model import ModelRecipe
from pipeline.interop.hf_context_parallel import context_parallel_hf
from pipeline.interop.hf_layers import causal_lm_targets, layers_from_hf
from pipeline.interop.hf_tensor_parallel import check_tensor_parallel_size, tensor_parallel_hf
from pipeline.parallel.context import check_context_parallel_sequence

__all__ = ["build"]

CONFIG = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2,
                                  vocab_size=256, max_position_embeddings=64)
SEQUENCE = 32


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids (the same on every rank for a step) and their causal-LM labels."""
    ids = torch.randint(0, CONFIG.vocab_size, (size, SEQUENCE),
                        generator=torch.Generator().manual_seed(step))
    return ids, causal_lm_targets(ids)


def build() -> ModelRecipe:
    hf = tensor_parallel_hf(layers_from_hf(CONFIG), sequence_parallel=True, overlap=True)
    hf = context_parallel_hf(hf)  # at --cp 1: the whole sequence, as without it
    return ModelRecipe(layers=hf.layers, loss_fn=hf.loss_fn, batch=batch,
                       check_tensor_parallel=functools.partial(check_tensor_parallel_size,
                                                               CONFIG),
                       check_context_parallel=functools.partial(
                           check_context_parallel_sequence, SEQUENCE))
