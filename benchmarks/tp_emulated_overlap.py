"""Part 1 of `bench_tensor_parallel`: exposed tp communication of blocks on emulated devices.

Two `ParallelTransformerBlock`s, or two blocks of a HF Llama split by `tensor_parallel_hf`,
whose GEMMs and collectives are timed waits (`pipeline.rehearsal.emulated_tp`); one rank's
nominal step minus its step with free collectives, beside `predict_blocks_exposed`.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch
import torch.distributed as dist
from bench_common import timed_step
from torch import nn

from pipeline.parallel.tensor.layers import ParallelTransformerBlock, TransformerBlock
from pipeline.parallel.tensor.sequence import split_sequence
from pipeline.rehearsal.emulated import WallClock
from pipeline.rehearsal.emulated_tp import (
    EmulatedTensorParallelCosts,
    EmulatedTensorParallelOps,
    LinearShape,
    predict_blocks_exposed,
)

__all__ = ["emulated_overlap_rank"]


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


def emulated_overlap_rank(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One rank of part 1: per (blocks, sequence parallel, overlap), the step time, its
    measured exposed tp communication and the rule's prediction."""
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
        pairs = [(timed_step(steps["nominal"]), timed_step(steps["free"]))
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
