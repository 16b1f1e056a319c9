"""Tiny HF causal LMs built from configs (no download), for the adapter tests (test helper)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["FAMILIES", "tiny_config", "tiny_model", "token_batch"]

FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
VOCAB = 50


def tiny_config(family: str, *, tied: bool = True) -> Any:
    """2 layers, hidden 32, no dropout (so the pipeline and HF draw no random numbers).

    Sliding windows of 4 tokens where a family has them (Mistral and Phi-3 on every layer,
    Gemma's first layer), so 8-token batches reach past them; Gemma 2 soft-caps its
    attention and final logits (its defaults, 50 and 30), Gemma 3 its final logits."""
    import transformers

    if family == "gpt2":
        return transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB,
                                       n_positions=16, embd_pdrop=0.0, resid_pdrop=0.0,
                                       attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                 max_position_embeddings=16, tie_word_embeddings=tied, bos_token_id=0,
                 eos_token_id=0, pad_token_id=None)
    extra: dict[str, Any] = {
        "mistral": dict(sliding_window=4),
        "qwen3": dict(head_dim=8),
        "phi3": dict(sliding_window=4, resid_pdrop=0.0, embd_pdrop=0.0),
        "gemma2": dict(head_dim=8, sliding_window=4, query_pre_attn_scalar=8,
                       layer_types=["sliding_attention", "full_attention"]),
        "gemma3_text": dict(head_dim=8, sliding_window=4, query_pre_attn_scalar=8,
                            layer_types=["sliding_attention", "full_attention"],
                            final_logit_softcapping=20.0),
    }.get(family, {})
    config_class = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                    "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
                    "phi3": transformers.Phi3Config, "gemma2": transformers.Gemma2Config,
                    "gemma3_text": transformers.Gemma3TextConfig}[family]
    return config_class(**shape, **extra)


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
