"""Tiny HF causal LMs built from configs (no download), for the adapter tests (test helper)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["FAMILIES", "tiny_config", "tiny_model", "token_batch"]

FAMILIES = ("gpt2", "llama", "mistral", "qwen2")
VOCAB = 50


def tiny_config(family: str, *, tied: bool = True) -> Any:
    """2 layers, hidden 32, no dropout (so the pipeline and HF draw no random numbers)."""
    import transformers

    if family == "gpt2":
        return transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB,
                                       n_positions=16, embd_pdrop=0.0, resid_pdrop=0.0,
                                       attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                 max_position_embeddings=16, tie_word_embeddings=tied, bos_token_id=0,
                 eos_token_id=0, pad_token_id=None)
    config_class = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                    "qwen2": transformers.Qwen2Config}[family]
    return config_class(**shape)


def tiny_model(family: str, *, tied: bool = True, seed: int = 0) -> nn.Module:
    """The HF model of `tiny_config`, seeded (the same on every rank)."""
    import transformers

    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(family, tied=tied))


def token_batch(batch: int, length: int, *, seed: int = 0,
                padded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and an attention mask; `padded` right-pads rows to different lengths."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    if padded:
        for row in range(batch):
            keep = int(torch.randint(2, length + 1, (1,), generator=generator))
            mask[row, keep:] = 0
            ids[row, keep:] = 0
    return ids, mask
