"""Activation bytes the engine holds, counted, against the planner's prediction for the same
shape: one pipeline stage of the engine's own tensor-parallel layers (a vocab-parallel
embedding, `ParallelTransformerBlock`s, a norm and column-parallel head, Megatron's
vocab-parallel cross entropy) at tp = t, for every recomputation mode, with and without
sequence parallelism (Korthikanti et al. 2022). Shared by the test and
`benchmarks/bench_activation_counts.py`; run on t gloo ranks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from pipeline import LayerSpec, PipelineEngine, PipelineModule
from pipeline.parallel.tensor.collectives import tp_rank_and_size
from pipeline.parallel.tensor.layers import (
    ColumnParallelLinear,
    ParallelTransformerBlock,
    VocabParallelEmbedding,
)
from pipeline.parallel.tensor.overlap import reduce_grad
from pipeline.parallel.tensor.sequence import ScatterSequence
from pipeline.parallel.tensor.vocab_cross_entropy import vocab_parallel_token_losses
from pipeline.planner import PRESETS, PlanConfig, PlanContext, parse_shape, transformer_profile
from pipeline.runtime.saved_memory import SavedTensorMeter

__all__ = ["MODES", "Count", "ParallelHead", "count_activations", "launched_counts",
           "predicted_activations"]

MODES = ("none", "selective", "full")
# the paper's notation: s sequence, b microbatch, h hidden, a heads, f MLP width, V vocab,
# L blocks; t (the tp size) is the world size of the launch
S, B, H, A, FFN, VOCAB, L = 64, 2, 64, 4, 256, 256, 2


@dataclass(frozen=True)
class Count:
    """One (recompute mode, sequence parallel) point: bytes of one microbatch on the stage."""

    mode: str
    sequence_parallel: bool
    counted: int
    """The engine's peak of saved bytes during a one-microbatch step (`SavedTensorMeter`)."""
    predicted: float
    """The planner's activations held between the forward and the backward at that step's
    peak (`PlanContext.held_trace` of its stage table): what the meter sees. The
    recomputation workspace the planner adds in the backward is not in it: torch's
    checkpoint keeps what it recomputes out of the saved-tensor hooks."""


class ParallelHead(nn.Module):
    """The final norm (on the sequence slice under sequence parallelism, its gradients then
    all-reduced over tp) and the column-parallel output projection: this rank's vocabulary
    slice of the logits, for `vocab_parallel_token_losses`."""

    def __init__(self, hidden: int, vocab: int, group: ProcessGroup | None, *,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.norm = nn.LayerNorm(hidden)
        self.proj = ColumnParallelLinear(hidden, vocab, group, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.norm
        if self.sequence_parallel:
            x = F.layer_norm(x, norm.normalized_shape, reduce_grad(norm.weight, self.group),
                             reduce_grad(norm.bias, self.group), norm.eps)
        else:
            x = norm(x)
        return self.proj(x)


def _vocab_parallel_loss(group: ProcessGroup, logits: torch.Tensor, targets: torch.Tensor
                         ) -> torch.Tensor:
    rank, _ = tp_rank_and_size(group)
    losses, counted = vocab_parallel_token_losses(logits, targets, rank * logits.shape[-1],
                                                  group, -100)
    return losses.sum() / counted.sum()


def _layers(sequence_parallel: bool) -> list[Any]:
    sp = sequence_parallel
    return ([LayerSpec(VocabParallelEmbedding, VOCAB, H)]
            + ([LayerSpec(ScatterSequence)] if sp else [])
            + [LayerSpec(ParallelTransformerBlock, H, A, ffn_hidden=FFN, sequence_parallel=sp)
               for _ in range(L)]
            + [LayerSpec(ParallelHead, H, VOCAB, sequence_parallel=sp)])


def predicted_activations(mode: str, sequence_parallel: bool, t: int) -> float:
    """The planner's activation bytes held at the peak of a one-microbatch step of `B`
    samples (recomputation workspace aside): pp 1, tp t, fp32 activations, fused attention,
    no dropout."""
    shape = parse_shape(f"layers={L},hidden={H},heads={A},vocab={VOCAB},seq={S},ffn={FFN},"
                        "dropout=false")
    model = transformer_profile(shape, "fp32", attention="fused",
                                sequence_parallel=sequence_parallel)
    context = PlanContext(model, replace(PRESETS["a100-80g"], nodes=1), B, "fp32")
    config = PlanConfig(pp=1, tp=t, dp=1, schedule="1f1b", chunks=1, microbatch_size=B,
                        num_microbatches=1, zero_stage=0, recompute=mode)
    trace = context.held_trace(config)
    assert trace is not None
    return float(trace.peak_bytes(context.table(config).held * B)[0])


def count_activations(rank: int, size: int) -> list[Count]:
    """On each of the `size` tp ranks: every (mode, sequence parallel) point's counted and
    predicted bytes."""
    torch.set_num_threads(1)
    group = dist.group.WORLD
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (B, S), generator=generator)
    targets = torch.randint(0, VOCAB, (B, S), generator=generator)
    counts = []
    for sequence_parallel in (False, True):
        for mode in MODES:
            torch.manual_seed(0)
            module = PipelineModule(_layers(sequence_parallel), num_stages=1,
                                    recompute=mode,  # type: ignore[arg-type]
                                    loss_fn=functools.partial(_vocab_parallel_loss, group))
            engine = PipelineEngine(module, schedule="1f1b", num_microbatches=1,
                                    tensor_parallel=size, timeout=60,
                                    optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))
            meter = SavedTensorMeter(ignore=[*module.parameters(), ids, targets])
            with meter:
                engine.train_batch(ids, targets)
            engine.stop_watchdog()
            counts.append(Count(mode, sequence_parallel, meter.peak,
                                predicted_activations(mode, sequence_parallel, size)))
    return counts


def launched_counts() -> list[Count]:
    """`count_activations` of this launched rank (for `pipeline.launch`)."""
    return count_activations(dist.get_rank(), dist.get_world_size())
