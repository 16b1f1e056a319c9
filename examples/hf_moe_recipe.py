"""A tiny Mixtral for `pipesched train --model ...:build --expert-parallel 2` (no download).

    pipesched train --model examples/hf_moe_recipe.py:build --stages 2 --data-parallel 2 \\
        --expert-parallel 2

The load-balancing loss is off (``output_router_logits=False``): `pipesched train` steps with
`engine.train_batch`, and HF's balancing loss needs `train_batch_balanced`.
"""

from __future__ import annotations

import torch
import transformers

from pipeline.demo.user_model import ModelRecipe
from pipeline.interop.hf_layers import causal_lm_targets, layers_from_hf

__all__ = ["build"]

CONFIG = transformers.MixtralConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    num_local_experts=4, num_experts_per_tok=2,
                                    vocab_size=128, max_position_embeddings=32,
                                    output_router_logits=False)


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids (the same on every rank for a step) and their causal-LM labels."""
    ids = torch.randint(0, CONFIG.vocab_size, (size, 16),
                        generator=torch.Generator().manual_seed(step))
    return ids, causal_lm_targets(ids)


def build() -> ModelRecipe:
    hf = layers_from_hf(CONFIG)
    return ModelRecipe(layers=hf.layers, loss_fn=hf.loss_fn, batch=batch)
