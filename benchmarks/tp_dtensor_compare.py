"""Part 2 of `bench_tensor_parallel`: Llama-shaped blocks at tp, ours against DTensor (real).

torchtitan's Llama block (RMSNorm, q/k/v/o, SiLU-gated MLP), the same block on our
`ColumnParallelLinear` / `RowParallelLinear` with sequence parallelism (fused q;k;v and
gate;up), and the block under `parallelize_module` with torchtitan's tp plan; one rank's
output check and forward + backward + SGD step timings.
"""

from __future__ import annotations

import argparse
import copy
import statistics
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_common import timed_step
from torch import nn

from pipeline.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from pipeline.parallel.tensor.sequence import reduce_grad_over_tensor_parallel, split_sequence

__all__ = ["Attention", "FeedForward", "LlamaBlock", "OurLlamaBlock", "RMSNorm",
           "dtensor_compare_rank"]


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(hidden)), eps

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.weight if weight is None else weight
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int) -> torch.Tensor:
    b, s, _ = q.shape

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(b, s, -1, head_dim).transpose(1, 2)

    out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
    return out.transpose(1, 2).reshape(b, s, -1)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(hidden, hidden, bias=False)
                                              for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(_attend(self.wq(x), self.wk(x), self.wv(x), self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    """torchtitan's Llama block, names included (its tp plan addresses them)."""

    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(hidden), RMSNorm(hidden)
        self.attention, self.feed_forward = Attention(hidden, heads), FeedForward(hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


def _fused(*layers: nn.Linear) -> nn.Linear:
    fused = nn.Linear(layers[0].in_features, sum(x.out_features for x in layers), bias=False)
    fused.weight.data.copy_(torch.cat([x.weight.detach() for x in layers]))
    return fused


class OurLlamaBlock(nn.Module):
    """The same block on our layers, sequence parallel: q;k;v and gate;up fused, so one
    all-gather each (Megatron-Core's layout)."""

    def __init__(self, full: LlamaBlock, group: Any, overlap: bool) -> None:
        super().__init__()
        options = {"sequence_parallel": True, "overlap": overlap}
        self.group, self.head_dim = group, full.attention.head_dim
        self.attention_norm, self.ffn_norm = (copy.deepcopy(full.attention_norm),
                                              copy.deepcopy(full.ffn_norm))
        attention, mlp = full.attention, full.feed_forward
        self.qkv = ColumnParallelLinear.from_full(
            _fused(attention.wq, attention.wk, attention.wv), group, fused_parts=3, **options)
        self.wo = RowParallelLinear.from_full(attention.wo, group, **options)
        self.gate_up = ColumnParallelLinear.from_full(_fused(mlp.w1, mlp.w3), group,
                                                      fused_parts=2, **options)
        self.w2 = RowParallelLinear.from_full(mlp.w2, group, **options)

    def _norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return norm(x, reduce_grad_over_tensor_parallel(norm.weight, self.group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self._norm(self.attention_norm, x)).chunk(3, dim=-1)
        h = x + self.wo(_attend(q, k, v, self.head_dim))
        gate, up = self.gate_up(self._norm(self.ffn_norm, h)).chunk(2, dim=-1)
        return h + self.w2(F.silu(gate) * up)


def _dtensor_blocks(plain: list[LlamaBlock], size: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (size,))
    plan = {  # torchtitan's Llama plan (apply_tp), per block
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1),),
                                        desired_input_layouts=(Replicate(),)),
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                           desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    blocks = nn.Sequential(*(copy.deepcopy(block) for block in plain))
    for block in blocks:
        parallelize_module(block, mesh, plan)
    return blocks


def dtensor_compare_rank(args: argparse.Namespace) -> dict[str, Any]:
    """One rank of part 2: each implementation's output against the single-process blocks
    (max difference), then its median step seconds."""
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    torch.manual_seed(0)
    plain = [LlamaBlock(args.llama_hidden, args.llama_heads, args.llama_ffn)
             for _ in range(args.blocks)]
    x_full = torch.randn(args.batch, args.llama_seq, args.llama_hidden)
    x = split_sequence(x_full, size, rank)
    models: dict[str, nn.Module] = {
        "ours": nn.Sequential(*(OurLlamaBlock(b, group, False) for b in plain)),
        "ours, overlap": nn.Sequential(*(OurLlamaBlock(b, group, True) for b in plain)),
        "DTensor": _dtensor_blocks(plain, size),
    }
    with torch.no_grad():  # the single-process blocks, this rank's slice of their output
        expected = x_full
        for block in plain:
            expected = block(expected)
        expected = split_sequence(expected, size, rank)
    differences = {}
    for name, model in models.items():
        with torch.no_grad():
            y = model(x)
        y = y.to_local() if hasattr(y, "to_local") else y
        differences[name] = float((y - expected).abs().max())
    steps = {}
    for name, model in models.items():
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, foreach=False)

        def step(model: nn.Module = model, optimizer: torch.optim.Optimizer = optimizer
                 ) -> None:
            optimizer.zero_grad()
            y = model(x.clone().requires_grad_())
            y = y.to_local() if hasattr(y, "to_local") else y
            y.pow(2).mean().backward()
            optimizer.step()

        steps[name] = step
    # one step of each per round, so the host's load hits every implementation alike
    rounds = [{name: timed_step(step) for name, step in steps.items()}
              for _ in range(args.steps + 2)][2:]
    seconds = {name: statistics.median(r[name] for r in rounds) for name in steps}
    return {"seconds": seconds, "max_difference": differences}
