"""Tensor-parallel communication overlap on emulated devices, and our tp step against DTensor's.

Part 1 (emulated): two `ParallelTransformerBlock`s, and two blocks of a HF Llama split by
`tensor_parallel_hf` (fused q;k;v and gate;up, o_proj, down_proj), whose GEMMs and
collectives are timed waits (`pipeline.rehearsal.emulated_tp`), so tp ranks > cores overlap
for real (the HF blocks' attention core, rotary and norms run for real, alike in both steps
below). Per (blocks, sequence parallel, overlap): the exposed tp communication of one
forward + backward, measured as the step with the nominal collective costs minus the same
step with free collectives, beside the rule's prediction (`schedules.analysis.tp_overlap`,
the planner's), and measured / predicted.

Part 2 (real compute, gloo CPU, same run): Llama-shaped blocks (RMSNorm, q/k/v/o, SiLU-gated
MLP) at tp with sequence parallelism, ours (`ColumnParallelLinear` / `RowParallelLinear`,
fused qkv and gate/up, with and without overlap) against torch's DTensor tensor parallelism
(`parallelize_module` with torchtitan's Llama plan: SequenceParallel norms, Colwise q/k/v and
gate/up, Rowwise o and down to Shard(1)). One forward + backward + SGD step, one step of each
implementation per round (median of rounds); each one's output is checked against the
single-process blocks first.

    python benchmarks/bench_tensor_parallel.py                 # tp 4 emulated, tp 2 real
    python benchmarks/bench_tensor_parallel.py --tp 2 --steps 10
    python benchmarks/bench_tensor_parallel.py --skip-real --models hf   # HF blocks only
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeline import launch
from pipeline.parallel.tensor.layers import (
    ColumnParallelLinear,
    ParallelTransformerBlock,
    RowParallelLinear,
    TransformerBlock,
)
from pipeline.parallel.tensor.sequence import reduce_grad_over_tensor_parallel, split_sequence
from pipeline.rehearsal.emulated import WallClock
from pipeline.rehearsal.emulated_tp import (
    EmulatedTensorParallelCosts,
    EmulatedTensorParallelOps,
    LinearShape,
    predict_blocks_exposed,
)

__all__ = ["main"]

# ---------------------------------------------------------------- part 1: emulated devices
def _timed_step(step: Callable[[], None]) -> float:
    """Seconds of one `step` on every rank (barriers around it)."""
    dist.barrier()
    start = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - start


def _hf_llama_blocks(args: argparse.Namespace, group: Any, sequence_parallel: bool,
                     overlap: bool, ops: EmulatedTensorParallelOps) -> list[nn.Module]:
    """A HF Llama's decoder blocks (h, heads, f as the engine blocks; no kv grouping) split
    by `tensor_parallel_hf` with these ops: its fused q;k;v and gate;up and its o_proj and
    down_proj are the emulated linears; the attention core, rotary and norms run for real
    (the same in the nominal and the free step, so not in their difference)."""
    import transformers

    from pipeline.interop.hf_layers import layers_from_hf
    from pipeline.interop.hf_tensor_parallel import tensor_parallel_hf

    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.blocks,
        num_attention_heads=args.heads, num_key_value_heads=args.heads, vocab_size=64,
        max_position_embeddings=args.seq)
    hf = tensor_parallel_hf(layers_from_hf(config), sequence_parallel=sequence_parallel,
                            overlap=overlap, overlap_chunks=args.chunks, ops=ops)
    return [spec.typename(*spec.args, group=group) for spec in hf.layers[1:1 + args.blocks]]


def _hf_linears(args: argparse.Namespace, tp: int) -> list[LinearShape]:
    """The HF Llama block's linears on one rank: q;k;v, o_proj, gate;up, down_proj."""
    return [("column", args.hidden, 3 * args.hidden // tp), ("row", args.hidden // tp, args.hidden),
            ("column", args.hidden, 2 * args.ffn // tp), ("row", args.ffn // tp, args.hidden)]


def _emulated_rank(args: argparse.Namespace) -> list[dict[str, Any]]:
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    costs = EmulatedTensorParallelCosts(flop_seconds=args.flop_ns * 1e-9,
                                        byte_seconds=args.byte_ns * 1e-9,
                                        latency=args.latency_ms * 1e-3)
    free = EmulatedTensorParallelCosts(flop_seconds=costs.flop_seconds, byte_seconds=0.0)
    torch.manual_seed(0)
    plain = [TransformerBlock(args.hidden, args.heads, ffn_hidden=args.ffn)
             for _ in range(args.blocks)]
    positions = torch.arange(args.seq).unsqueeze(0)
    rows = []
    for kind, sequence_parallel, overlap in (
            (kind, sp, on) for kind in args.models.split(",") for sp in (False, True)
            for on in (False, True)):
        x = torch.randn(args.batch, args.seq, args.hidden)
        if sequence_parallel:
            x = split_sequence(x, size, rank)
        steps = {}
        for name, model in (("nominal", costs), ("free", free)):
            ops = EmulatedTensorParallelOps(
                model, WallClock(carry_window=args.carry_ms * 1e-3))
            blocks = _hf_llama_blocks(args, group, sequence_parallel, overlap, ops) \
                if kind == "hf" else [ParallelTransformerBlock.from_full(
                    block, group, sequence_parallel=sequence_parallel, overlap=overlap,
                    chunks=args.chunks, ops=ops) for block in plain]

            def step(blocks: list[nn.Module] = blocks, x: torch.Tensor = x,
                     hf: bool = kind == "hf") -> None:
                y = x.clone().requires_grad_()
                for block in blocks:
                    y = block((y, positions))[0] if hf else block(y)
                y.sum().backward()

            steps[name] = step
        # nominal and free steps alternate, so the host's load hits both alike; the
        # exposed time is the median of the pairs' differences
        pairs = [(_timed_step(steps["nominal"]), _timed_step(steps["free"]))
                 for _ in range(args.steps + 1)][1:]
        measured = {"nominal": statistics.median(a for a, _ in pairs),
                    "exposed": statistics.median(a - b for a, b in pairs)}
        predicted = predict_blocks_exposed(  # HF's norm-gradient sums: real, not ops
            costs, tp=size, batch=args.batch, seq=args.seq, hidden=args.hidden,
            ffn=args.ffn, blocks=args.blocks, sequence_parallel=sequence_parallel,
            overlap=overlap, chunks=args.chunks,
            linear_shapes=_hf_linears(args, size) if kind == "hf" else None,
            slice_reductions=0 if kind == "hf" else 6)
        rows.append({"model": kind, "sequence_parallel": sequence_parallel,
                     "overlap": overlap,
                     "step": measured["nominal"], "exposed": measured["exposed"],
                     "predicted": predicted})
    return rows


# ---------------------------------------------------- part 2: ours against DTensor (real)
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


def _real_rank(args: argparse.Namespace) -> dict[str, Any]:
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
    rounds = [{name: _timed_step(step) for name, step in steps.items()}
              for _ in range(args.steps + 2)][2:]
    seconds = {name: statistics.median(r[name] for r in rounds) for name in steps}
    return {"seconds": seconds, "max_difference": differences}


# ------------------------------------------------------------------------------- main
def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=4, help="emulated tp size (default 4)")
    parser.add_argument("--real-tp", type=int, default=2, help="tp of the DTensor comparison")
    parser.add_argument("--steps", type=int, default=9, help="timed steps per row (median)")
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=2, help="overlap chunks")
    parser.add_argument("--flop-ns", type=float, default=60.0,
                        help="emulated ns per GEMM FLOP (default 60: a 128·64·64 GEMM 63 ms; "
                             "waits must dwarf the host's Python on a loaded machine)")
    parser.add_argument("--byte-ns", type=float, default=1200.0,
                        help="emulated ns per byte through the link")
    parser.add_argument("--latency-ms", type=float, default=6.0)
    parser.add_argument("--carry-ms", type=float, default=10.0,
                        help="an op issued this soon after the last wait ends starts where it "
                             "was due (a device queue the host keeps ahead of; emulated."
                             "WallClock's carry window; default 10: Python gaps on a loaded "
                             "host)")
    parser.add_argument("--llama-seq", type=int, default=128)
    parser.add_argument("--llama-hidden", type=int, default=256)
    parser.add_argument("--llama-heads", type=int, default=8)
    parser.add_argument("--llama-ffn", type=int, default=704)
    parser.add_argument("--skip-real", action="store_true", help="part 1 only")
    parser.add_argument("--models", default="engine,hf",
                        help="part 1's blocks: engine (ParallelTransformerBlock), hf (a HF "
                             "Llama's, tensor_parallel_hf); default both")
    args = parser.parse_args(argv)
    unknown = set(args.models.split(",")) - {"engine", "hf"}
    if unknown:
        parser.error(f"--models {args.models}: {', '.join(sorted(unknown))} is not engine or hf")
    return args


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    rows = launch(_emulated_rank, args.tp, args, timeout=120.0, join_timeout=1800.0)[0]
    real = None if args.skip_real else launch(_real_rank, args.real_tp, args, timeout=120.0,
                                              join_timeout=1800.0)[0]
    print(f"## Exposed tp communication per step, emulated devices (tp {args.tp}, "
          f"{args.blocks} blocks, b {args.batch}, s {args.seq}, h {args.hidden}, "
          f"f {args.ffn}, chunks {args.chunks})\n")
    print("| blocks | sequence parallel | overlap | step ms | exposed tp comm ms (measured) | "
          "predicted ms | measured / predicted |")
    print("|---|---|---|---|---|---|---|")
    names = {"engine": "ParallelTransformerBlock", "hf": "HF Llama (tensor_parallel_hf)"}
    for row in rows:
        ratio = row["exposed"] / row["predicted"] if row["predicted"] else float("nan")
        print(f"| {names[row['model']]} | {row['sequence_parallel']} | {row['overlap']} | "
              f"{row['step'] * 1e3:.1f} | {row['exposed'] * 1e3:.1f} | "
              f"{row['predicted'] * 1e3:.1f} | {ratio:.3f} |")
    for kind in dict.fromkeys(row["model"] for row in rows):
        for sp in (False, True):
            off, on = (next(r for r in rows if r["model"] == kind
                            and r["sequence_parallel"] == sp and r["overlap"] == o)
                       for o in (False, True))
            print(f"\n{names[kind]}, sequence parallel {sp}: overlap hides "
                  f"{1 - on['exposed'] / off['exposed']:.0%} of the exposed tp communication "
                  f"(predicted {1 - on['predicted'] / off['predicted']:.0%})")
    if real is not None:
        seconds = real["seconds"]
        print(f"\n## Llama-shaped blocks, real compute, gloo CPU, tp {args.real_tp}, sequence "
              f"parallel (b {args.batch}, s {args.llama_seq}, h {args.llama_hidden}, "
              f"heads {args.llama_heads}, f {args.llama_ffn}, {args.blocks} blocks)\n")
        print("| implementation | step ms | / DTensor | max |output - single process| |")
        print("|---|---|---|---|")
        for name, value in seconds.items():
            print(f"| {name} | {value * 1e3:.1f} | {value / seconds['DTensor']:.2f} | "
                  f"{real['max_difference'][name]:.1e} |")


if __name__ == "__main__":
    main()
