"""The planner prices overlapped tensor-parallel communication by the engine's rule: each block's
exposed collectives equal an event simulation of the engine's op order on the kernel model's
GEMM times and the network model's collectives."""

from __future__ import annotations

import pytest

from pipeline.planner import PRESETS, SearchOptions, parse_shape, plan, transformer_profile
from pipeline.planner.kernels import block_linear_times
from pipeline.planner.pricing import allreduce_seconds, layer_tp_pass_seconds, layer_tp_seconds
from schedules.analysis.tp_overlap import ParallelLinearCosts
from tests.schedules.test_tp_overlap import _exposed, _ops

A100 = PRESETS["a100-80g"]
SHAPE = "layers=8,hidden=4096,heads=32,vocab=32000,seq=4096"


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_block_exposed_tp_seconds_follow_the_engine_order(sequence_parallel: bool,
                                                          overlap: bool) -> None:
    tp, batch = 8, 1
    layer = transformer_profile(parse_shape(SHAPE), sequence_parallel=sequence_parallel,
                                tp_comm_overlap=overlap).layers[1]
    assert layer.shape is not None
    # oracle: the event simulation over this block's GEMMs and its collectives, halved
    # (all-gather / reduce-scatter) with sequence parallelism
    halves = 2 if sequence_parallel else 1
    nbytes = layer.tp_allreduce_bytes * batch
    whole = allreduce_seconds(nbytes, tp, 1, A100) / halves
    chunk = allreduce_seconds(nbytes / 2, tp, 1, A100) / halves
    forward = backward = 0.0
    for kind, times in block_linear_times(layer.shape, batch, tp, A100, "bf16"):
        ops = _ops(ParallelLinearCosts(kind, *times, whole, chunk), sequence_parallel,
                   overlap, 2)
        forward += _exposed(ops[0])
        backward += _exposed(ops[1])
    got = layer_tp_pass_seconds(layer, A100, "bf16", batch, tp)
    assert got == pytest.approx((forward, backward), rel=1e-9)
    all_reduces = layer_tp_seconds(layer, A100, batch, tp)  # two all-reduces a pass
    if overlap:
        assert 0 < sum(got) < 2 * all_reduces  # the GEMMs hide part, never all, here
    elif sequence_parallel:  # the backward's re-gather: 3 halves a sub-layer, not 2
        assert got == pytest.approx((all_reduces, 1.5 * all_reduces))
    else:
        assert got == (all_reduces, all_reduces)


def test_plan_reports_less_tp_communication_with_overlap() -> None:
    options = SearchOptions(tensor_parallel=(8,), pipeline_parallel=(1,), zero_stages=(0,),
                            microbatch_sizes=(1,), recompute_choices=(False,), top=1)
    found = {overlap: plan(transformer_profile(parse_shape(SHAPE), tp_comm_overlap=overlap),
                           A100, 8, options=options).best
             for overlap in (False, True)}
    assert found[True].breakdown["tp_comm"] < found[False].breakdown["tp_comm"]
    assert found[True].step_seconds < found[False].step_seconds
    assert sum(found[True].breakdown.values()) == pytest.approx(found[True].step_seconds)
