"""The planner prices this engine's overlapped tensor-parallel communication (`tp_overlap`
"pipesched", `pipesched plan --tp-comm-overlap`) by the engine's rule: each block's exposed
collectives equal an event simulation of the engine's op order on the kernel model's GEMM
times (GPT and SwiGLU/GQA shapes) and the network model's collectives; sequence parallelism's
backward re-gather is charged once."""

from __future__ import annotations

import json

import pytest

from pipeline.cli import main
from pipeline.planner import PRESETS, SearchOptions, parse_shape, plan, transformer_profile
from pipeline.planner.kernels import block_linear_times
from pipeline.planner.pricing import allreduce_seconds, layer_tp_pass_seconds, layer_tp_seconds
from schedules.analysis.tp_overlap import ParallelLinearCosts
from tests.schedules.test_tp_overlap import _exposed, _ops

__all__: list[str] = []

A100 = PRESETS["a100-80g"]
SHAPE = "layers=8,hidden=4096,heads=32,vocab=32000,seq=4096"
SWIGLU = "layers=8,hidden=4096,heads=32,kv_heads=8,ffn=14336,mlp=swiglu,vocab=32000,seq=4096"


@pytest.mark.parametrize("shape", [SHAPE, SWIGLU])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_block_exposed_tp_seconds_follow_the_engine_order(shape: str, sequence_parallel: bool,
                                                          overlap: bool) -> None:
    tp, batch = 8, 1
    layer = transformer_profile(parse_shape(shape),
                                sequence_parallel=sequence_parallel).layers[1]
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
    got = layer_tp_pass_seconds(layer, A100, "bf16", batch, tp,
                                "pipesched" if overlap else "none")
    assert got == pytest.approx((forward, backward), rel=1e-9)
    all_reduces = layer_tp_seconds(layer, A100, batch, tp)  # two all-reduces a pass
    if overlap:
        assert 0 < sum(got) < 2 * all_reduces  # the GEMMs hide part, never all, here
    elif sequence_parallel:  # the backward's re-gather: 3 halves a sub-layer, not 2
        assert got == pytest.approx((all_reduces, 1.5 * all_reduces))
    else:
        assert got == (all_reduces, all_reduces)


def test_the_embedding_and_head_have_no_overlap_rule() -> None:
    model = transformer_profile(parse_shape(SWIGLU), sequence_parallel=True)
    for layer in (model.layers[0], model.layers[-1]):
        assert layer_tp_pass_seconds(layer, A100, "bf16", 1, 8, "pipesched") == \
            layer_tp_pass_seconds(layer, A100, "bf16", 1, 8)


def _best(overlap: str, sequence_parallel: bool = False) -> object:
    options = SearchOptions(tensor_parallel=(8,), pipeline_parallel=(1,), zero_stages=(0,),
                            microbatch_sizes=(1,), recompute_choices=(False,), top=1,
                            tp_overlap=overlap)
    model = transformer_profile(parse_shape(SHAPE), sequence_parallel=sequence_parallel)
    return plan(model, A100, 8, options=options).best


def test_plan_reports_less_tp_communication_with_overlap() -> None:
    found = {overlap: _best(overlap) for overlap in ("none", "pipesched")}
    assert found["pipesched"].breakdown["tp_comm"] < found["none"].breakdown["tp_comm"]
    assert found["pipesched"].step_seconds < found["none"].step_seconds
    assert sum(found["pipesched"].breakdown.values()) == \
        pytest.approx(found["pipesched"].step_seconds)


def test_a_step_charges_sequence_parallelism_s_re_gather_once() -> None:
    # pp 1, 8 microbatches of 1: the step's tp communication is 8 × the layers' passes
    model = transformer_profile(parse_shape(SHAPE), sequence_parallel=True)
    passes = 8 * sum(sum(layer_tp_pass_seconds(layer, A100, "bf16", 1, 8))
                     for layer in model.layers)
    plain = 8 * sum(2 * layer_tp_seconds(layer, A100, 1, 8) for layer in model.layers)
    found = _best("none", sequence_parallel=True)
    assert found.breakdown["tp_comm"] == pytest.approx(passes, rel=1e-9)
    assert plain < found.breakdown["tp_comm"] < 1.26 * plain  # blocks 1.25×, not 1.5² or 2×


def test_the_cli_flag_prices_the_engine_s_overlap_and_refuses_other_engines(
        capsys: pytest.CaptureFixture[str]) -> None:
    command = ["plan", "--model", SHAPE, "--cluster", "a100-80g", "--global-batch", "8",
               "--price", "pp1,tp8,dp1,b1", "--json"]
    tp_comm = []
    for extra in ([], ["--tp-comm-overlap"]):
        assert main([*command, *extra]) == 0
        tp_comm.append(json.loads(capsys.readouterr().out)["breakdown"]["tp_comm"])
    assert tp_comm[1] < tp_comm[0]
    for engine in ("megatron-core", "deepspeed", "megatron-2021"):
        assert main([*command, "--tp-comm-overlap", "--engine", engine]) != 0
        assert "drop --tp-comm-overlap" in capsys.readouterr().err
