"""Tiny HF mixture-of-experts causal LMs built from configs, for the MoE tests (test helper)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["MOE_FAMILIES", "expected_aux_free_biases", "plant_ties_and_an_idle_expert",
           "tiny_moe_config", "tiny_moe_model"]

MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
VOCAB = 50


def tiny_moe_config(family: str, *, top_k: int = 2, coefficient: float = 0.5,
                    tied: bool = False, groups: int = 4, top_groups: int | None = None,
                    q_rank: int | None = 12) -> Any:
    """2 layers, hidden 32, 4 experts of width 16, the balancing loss on with a coefficient
    large enough to move the gradients visibly; Qwen2-MoE with its gated shared expert and
    HF's default norm_topk_prob=False, Qwen3-MoE with norm_topk_prob=True, OLMoE with its
    clip_qkv set low enough to clamp. DeepSeek-V3: 4 layers (the first dense), 8 experts in
    `groups` groups of which `top_groups` stay eligible, one shared expert, low-rank q and
    kv (multi-head latent attention), vocab 128, no balancing loss (HF's adds none);
    `top_groups` None: 2. DeepSeek-V2: the same shape with a softmax router, group-limited
    (`groups` > 1; `top_groups` None: 1, so that the limit changes the top-2 choice, which
    two groups scored by their best expert never would) or greedy (`groups` 1), weights
    scaled by 1.5; `q_rank` None: q projected directly (V2-Lite)."""
    import transformers

    if family == "deepseek_v2":
        grouped = groups > 1
        return transformers.DeepseekV2Config(
            hidden_size=32, num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=128, max_position_embeddings=16,
            intermediate_size=24, moe_intermediate_size=16, n_routed_experts=8,
            n_shared_experts=1, num_experts_per_tok=top_k,
            topk_method="group_limited_greedy" if grouped else "greedy",
            n_group=groups if grouped else None,
            topk_group=(top_groups or 1) if grouped else None,
            routed_scaling_factor=1.5, q_lora_rank=q_rank, kv_lora_rank=8,
            qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, tie_word_embeddings=tied,
            bos_token_id=0, eos_token_id=0, pad_token_id=None)

    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(
            hidden_size=32, num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=128, max_position_embeddings=16,
            intermediate_size=24, moe_intermediate_size=16, n_routed_experts=8,
            n_shared_experts=1, num_experts_per_tok=top_k, n_group=groups,
            topk_group=top_groups or 2, q_lora_rank=q_rank, kv_lora_rank=8, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=8, tie_word_embeddings=tied, bos_token_id=0,
            eos_token_id=0, pad_token_id=None)

    shape = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16,
                 tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0, pad_token_id=None,
                 num_experts_per_tok=top_k, output_router_logits=True,
                 router_aux_loss_coef=coefficient)
    if family == "mixtral":
        return transformers.MixtralConfig(**shape, intermediate_size=16, num_local_experts=4)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**shape, intermediate_size=24,
                                           moe_intermediate_size=16, num_experts=4,
                                           shared_expert_intermediate_size=24)
    if family == "olmoe":  # every layer sparse, q/k norms, clip_qkv on
        return transformers.OlmoeConfig(**shape, intermediate_size=16, num_experts=4,
                                        clip_qkv=0.5)
    return transformers.Qwen3MoeConfig(**shape, intermediate_size=24, moe_intermediate_size=16,
                                       num_experts=4, head_dim=8, norm_topk_prob=True)


def tiny_moe_model(family: str, *, seed: int = 0, **options: Any) -> nn.Module:
    """The HF model of `tiny_moe_config`, seeded (the same on every rank)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_moe_config(family, **options))
    if family == "deepseek_v3":  # a correction bias that changes the choice (HF's init: 0)
        with torch.no_grad():
            for layer in model.model.layers[model.config.first_k_dense_replace:]:
                layer.mlp.gate.e_score_correction_bias.uniform_(-0.3, 0.3)
    return model


def plant_ties_and_an_idle_expert(model: nn.Module) -> None:
    """Every router's rows become (v, v, -v, 0) for one random v: experts 0 and 1 always tie,
    and with top-1 routing expert 3 (logit 0, between s and -s) never gets a token."""
    with torch.no_grad():
        for layer in model.model.layers:
            gate = layer.mlp.gate.weight
            v = torch.randn(gate.shape[1]) * 4
            gate.copy_(torch.stack([v, v, -v, torch.zeros_like(v)]))


def expected_aux_free_biases(routes: tuple[torch.Tensor, ...]) -> dict[int, torch.Tensor]:
    """Tiny DeepSeek-V3's HF layer -> its aux-free bias after one step, by definition: the
    checkpoint's bias plus 1e-3 · sign(mean load - load), the loads counted from the choices
    HF's own router makes on the step's router logits (`routes`: one per MoE layer; an
    identity-weight copy of its router re-reads them)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    model: Any = tiny_moe_model("deepseek_v3", seed=3)
    dense = model.config.first_k_dense_replace
    assert len(routes) == len(model.model.layers) - dense
    expected = {}
    for index, layer in enumerate(model.model.layers[dense:], start=dense):
        config = tiny_moe_config("deepseek_v3")
        config.hidden_size = config.n_routed_experts
        router = DeepseekV3TopkRouter(config)
        with torch.no_grad():
            router.weight.copy_(torch.eye(config.n_routed_experts))
            router.e_score_correction_bias.copy_(layer.mlp.gate.e_score_correction_bias)
            chosen = router(routes[index - dense].float())[2]
        load = torch.bincount(chosen.reshape(-1), minlength=8).float()
        bias = layer.mlp.gate.e_score_correction_bias.detach()
        expected[index] = bias + 1e-3 * torch.sign(load.mean() - load)
    return expected
