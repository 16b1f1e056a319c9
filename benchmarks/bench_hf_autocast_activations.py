"""Bytes one tensor-parallel HF decoder layer saves under bf16 autocast against the fp32 eager
model the planner prices it with (`pipeline.planner.hf_activations`).

    PYTHONPATH=$PWD python benchmarks/bench_hf_autocast_activations.py

tp 2 (2 gloo ranks), a tiny grouped-query Llama and GPT-2 (h 48, s 10, b 3), with and without
sequence parallelism: the distinct storages autograd saves (parameters left out), split into
fp32, bf16 activations and autocast's bf16 copies of the weights (2-D, saved once per
microbatch), against `eager_layer_activation_bytes`. Counts are exact (no timing).
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

from pipeline import launch
from pipeline.interop.hf_layers import layers_from_hf
from pipeline.interop.hf_tensor_parallel import tensor_parallel_hf
from pipeline.parallel.tensor.sequence import split_sequence
from schedules.analysis.eager_activations import eager_layer_activation_bytes

__all__ = ["main"]

S, B, H = 10, 3, 48


def _config(family: str) -> Any:
    import transformers

    if family == "gpt2":
        return transformers.GPT2Config(n_embd=H, n_layer=2, n_head=4, vocab_size=50,
                                       n_positions=16, embd_pdrop=0.0, resid_pdrop=0.0,
                                       attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaConfig(hidden_size=H, intermediate_size=80, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    vocab_size=50, max_position_embeddings=16)


def _rows() -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    rows = []
    for family in ("llama", "gpt2"):
        for sequence_parallel in (False, True):
            hf = tensor_parallel_hf(layers_from_hf(_config(family)),
                                    sequence_parallel=sequence_parallel)
            spec = hf.layers[2 if family == "gpt2" else 1]
            torch.manual_seed(0)
            block = spec.typename(*spec.args, group=dist.group.WORLD)
            weights = {p.untyped_storage().data_ptr() for p in block.parameters()}
            saved: dict[int, torch.Tensor] = {}

            def pack(tensor: torch.Tensor, weights: set[int] = weights,
                     saved: dict[int, torch.Tensor] = saved) -> torch.Tensor:
                if tensor.untyped_storage().data_ptr() not in weights:
                    saved[tensor.untyped_storage().data_ptr()] = tensor
                return tensor

            hidden = torch.randn(B, S, H)
            if sequence_parallel:
                hidden = split_sequence(hidden, 2, dist.get_rank())
            hidden.requires_grad_()
            shapes = {tuple(p.shape) for p in block.parameters()} | \
                {tuple(p.shape[::-1]) for p in block.parameters()}
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                    torch.autocast("cpu", dtype=torch.bfloat16):
                out = block((hidden, torch.arange(S).expand(B, S)))
            kinds = {"fp32": 0, "bf16": 0, "weight copies": 0}
            for tensor in saved.values():
                size = tensor.untyped_storage().nbytes()
                if tensor.dtype == torch.float32:
                    kinds["fp32"] += size
                elif tensor.dim() == 2 and tuple(tensor.shape) in shapes:
                    kinds["weight copies"] += size
                else:
                    kinds["bf16"] += size
            del out
            config = _config(family)
            heads, kv = 4, getattr(config, "num_key_value_heads", 4)
            predicted = eager_layer_activation_bytes(
                S, B, H, heads, q_width=H, kv_width=kv * H // heads,
                ffn=4 * H if family == "gpt2" else 80, head_dim=H // heads,
                norm="layernorm" if family == "gpt2" else "rmsnorm", rotary=family != "gpt2",
                mlp_tensors=5 if family == "gpt2" else 4, t=2,
                sequence_parallel=sequence_parallel)
            rows.append({"family": family, "sp": sequence_parallel, **kinds,
                         "predicted": predicted})
    return rows


def main() -> None:
    rows = launch(_rows, 2, timeout=120, join_timeout=600)[0]
    print(f"bytes one decoder layer saves per tp rank under bf16 autocast (tp 2, s {S}, b {B}, "
          f"h {H}; rank 0) against the fp32 eager model")
    print(f"{'family':<7}{'SP':>4}{'fp32':>8}{'bf16':>8}{'weights':>9}{'total':>8}"
          f"{'fp32 model':>12}{'total/model':>13}")
    for row in rows:
        total = row["fp32"] + row["bf16"] + row["weight copies"]
        print(f"{row['family']:<7}{'on' if row['sp'] else 'off':>4}{row['fp32']:>8}"
              f"{row['bf16']:>8}{row['weight copies']:>9}{total:>8}{row['predicted']:>12.0f}"
              f"{total / row['predicted']:>13.3f}")


if __name__ == "__main__":
    main()
