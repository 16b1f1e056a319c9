"""The overlapped tp layers run on emulated devices with a virtual clock take exactly the time the
rule (`schedules.analysis.tp_overlap`) predicts: the engine's op order is the rule's, for its own
blocks and for a HF Llama's split by `tensor_parallel_hf`."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import pipeline.parallel.tensor.overlap as overlap_module
from pipeline.errors import PipelineConfigError
from pipeline.parallel.tensor.layers import ParallelTransformerBlock, TransformerBlock
from pipeline.parallel.tensor.sequence import split_sequence
from pipeline.rehearsal.emulated_tp import (
    EmulatedTensorParallelCosts,
    EmulatedTensorParallelOps,
    LinearShape,
    predict_blocks_exposed,
)
from tests.support.rank_harness import run_ranks

BATCH, SEQ, HIDDEN, HEADS, FFN, BLOCKS = 2, 8, 8, 2, 16, 2
COSTS = EmulatedTensorParallelCosts(flop_seconds=1e-6, byte_seconds=4e-5, latency=1e-3)


class VirtualClock:
    """Time that passes only by waiting: no host time, so a step lasts its nominal waits."""

    def __init__(self) -> None:
        self.time = 0.0

    def now(self) -> float:
        return self.time

    def sleep_until(self, deadline: float, label: str) -> None:
        self.time = max(self.time, deadline)


def _hf_llama_blocks(sequence_parallel: bool, overlap: bool,
                     ops: EmulatedTensorParallelOps) -> list[torch.nn.Module]:
    transformers = pytest.importorskip("transformers")
    from pipeline.interop.hf_layers import layers_from_hf
    from pipeline.interop.hf_tensor_parallel import tensor_parallel_hf

    config = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=FFN,
                                      num_hidden_layers=BLOCKS, num_attention_heads=HEADS,
                                      num_key_value_heads=HEADS, vocab_size=16,
                                      max_position_embeddings=SEQ)
    hf = tensor_parallel_hf(layers_from_hf(config), sequence_parallel=sequence_parallel,
                            overlap=overlap, ops=ops)
    return [spec.typename(*spec.args, group=dist.group.WORLD)
            for spec in hf.layers[1:1 + BLOCKS]]


def _step_seconds(costs: EmulatedTensorParallelCosts, sequence_parallel: bool,
                  overlap: bool, hf: bool) -> float:
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    clock = VirtualClock()
    ops = EmulatedTensorParallelOps(costs, clock)
    blocks = _hf_llama_blocks(sequence_parallel, overlap, ops) if hf else [
        ParallelTransformerBlock.from_full(
            TransformerBlock(HIDDEN, HEADS, ffn_hidden=FFN), dist.group.WORLD,
            sequence_parallel=sequence_parallel, overlap=overlap, chunks=2, ops=ops)
        for _ in range(BLOCKS)]
    x = torch.randn(BATCH, SEQ, HIDDEN)
    y = (split_sequence(x, size, rank) if sequence_parallel else x).requires_grad_()
    positions = torch.arange(SEQ).unsqueeze(0)
    for block in blocks:
        y = block((y, positions))[0] if hf else block(y)
    y.sum().backward()
    return clock.time


def _exposed(sequence_parallel: bool, overlap: bool, hf: bool = False) -> float:
    free = EmulatedTensorParallelCosts(flop_seconds=COSTS.flop_seconds, byte_seconds=0.0)
    return (_step_seconds(COSTS, sequence_parallel, overlap, hf)
            - _step_seconds(free, sequence_parallel, overlap, hf))


def _predicted(size: int, sequence_parallel: bool, overlap: bool, hf: bool = False) -> float:
    """The rule's time; a HF Llama block: fused q;k;v, o_proj, fused gate;up, down_proj, no
    biases, its norms' gradient sums real collectives outside the emulated ops."""
    linears: list[LinearShape] = [
        ("column", HIDDEN, 3 * HIDDEN // size), ("row", HIDDEN // size, HIDDEN),
        ("column", HIDDEN, 2 * FFN // size), ("row", FFN // size, HIDDEN)]
    return predict_blocks_exposed(COSTS, tp=size, batch=BATCH, seq=SEQ, hidden=HIDDEN,
                                  ffn=FFN, blocks=BLOCKS, sequence_parallel=sequence_parallel,
                                  overlap=overlap, chunks=2,
                                  linear_shapes=linears if hf else None,
                                  slice_reductions=0 if hf else 6)


def _engine_follows_the_rule(rank: int, size: int) -> None:
    for hf in (False, True):
        for sequence_parallel in (False, True):
            for overlap in (False, True):
                assert _exposed(sequence_parallel, overlap, hf) == pytest.approx(
                    _predicted(size, sequence_parallel, overlap, hf), rel=1e-9), \
                    (hf, sequence_parallel, overlap)
        assert _exposed(True, True, hf) < _exposed(True, False, hf)  # overlap hides some


def _planted_waits_at_once(rank: int, size: int) -> None:
    """Planted bug: every collective waited on as soon as launched: not the rule's time."""
    launch = overlap_module._launch
    overlap_module._launch = (  # type: ignore[assignment]
        lambda ops, overlap, *rest: launch(ops, False, *rest))
    assert _exposed(True, True) != pytest.approx(_predicted(size, True, True), rel=1e-3)


@pytest.mark.multiprocess
def test_overlapped_blocks_take_the_rules_time_on_a_virtual_clock() -> None:
    run_ranks(_engine_follows_the_rule, 2)


@pytest.mark.multiprocess
def test_a_planted_early_wait_misses_the_rule() -> None:
    run_ranks(_planted_waits_at_once, 2)


def test_bad_emulated_costs_are_refused_by_name() -> None:
    with pytest.raises(PipelineConfigError, match="emulated byte_seconds must be a finite"):
        EmulatedTensorParallelCosts(flop_seconds=1.0, byte_seconds=-1.0)
