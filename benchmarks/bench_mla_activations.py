"""Bytes HF's eager multi-head latent attention saves for its backward against what the planner
prices it at (`pipeline.planner.latent_attention.LatentAttention.kept_elements`, Korthikanti's
fused-layer convention).

    PYTHONPATH=$PWD python benchmarks/bench_mla_activations.py

One `DeepseekV3Attention` (SDPA, fp32, tp 1; the attention only, the block's norms and MLP
left out), b 2, s 16, h 64, 8 heads, r_kv 16, d_n 12, d_r 4, d_v 10, with a query latent of
24 and without one: the distinct storages autograd saves (parameters left out) against the
planner's attention bytes (its input x, the latents, Q, K, V, the core's output and the
fused kernel's log-sum-exp). Counts are exact (no timing).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from pipeline.planner.latent_attention import LatentAttention

__all__ = ["main", "saved_bytes"]

B, S, H, HEADS = 2, 16, 64, 8
SIZES = {"kv_lora_rank": 16, "qk_nope_head_dim": 12, "qk_rope_head_dim": 4, "v_head_dim": 10}


def saved_bytes(q_lora_rank: int) -> int:
    """Bytes of the distinct storages autograd saves for one HF MLA forward."""
    import transformers

    config = transformers.DeepseekV3Config(
        num_hidden_layers=1, hidden_size=H, num_attention_heads=HEADS, intermediate_size=96,
        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
        first_k_dense_replace=1, vocab_size=100, max_position_embeddings=32,
        q_lora_rank=q_lora_rank or None, n_group=4, topk_group=2, num_experts_per_tok=2,
        **SIZES)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    attention = model.model.layers[0].self_attn
    weights = {p.untyped_storage().data_ptr() for p in attention.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    x = torch.randn(B, S, H, requires_grad=True)
    rotary = model.model.rotary_emb(x, torch.arange(S).expand(B, S))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attention(x, rotary, None)
    return sum(saved.values())


def main() -> None:
    print(f"{'query latent':>12} {'autograd saves':>15} {'planner prices':>15} {'ratio':>6}")
    for rank in (24, 0):
        latent = LatentAttention(q_lora_rank=rank, **SIZES)
        whole, split = latent.kept_elements(HEADS)
        priced = 4 * B * S * (H + whole + split + HEADS)  # x, MLA's tensors, log-sum-exp
        counted = saved_bytes(rank)
        print(f"{rank or 'none':>12} {counted:>15,} {priced:>15,} {counted / priced:>6.2f}")


if __name__ == "__main__":
    main()
