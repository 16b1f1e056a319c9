"""The planner's recomputation modes (none, selective, full, partial-k): memory from the one
accounting, recomputation time, the search's choice among them, and how a pick is emitted."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeline.cli.plan_cmd import parse_config
from pipeline.planner import PRESETS, PlanConfig, SearchOptions, plan
from pipeline.planner.errors import PlanError
from pipeline.planner.search import price
from pipeline.planner.stages import StageTable
from pipeline.planner.transformer import TransformerShape
from pipeline.planner.transformer_layers import transformer_profile
from schedules.analysis.accounting import layer_activation_bytes

# long sequences, eager attention: the 5as² scores dominate, what selective drops
SHAPE = TransformerShape(layers=8, hidden=1024, heads=16, vocab=32000, seq=4096)
CLUSTER = replace(PRESETS["a100-80g"], nodes=1)


@pytest.mark.parametrize("attention", ["eager", "fused"])
@pytest.mark.parametrize("t", [1, 2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_block_memory_of_each_mode_equals_the_accounting(attention: str, t: int,
                                                         sequence_parallel: bool) -> None:
    block = transformer_profile(SHAPE, "bf16", attention=attention,
                                sequence_parallel=sequence_parallel).layers[1]
    s, h, a = SHAPE.seq, SHAPE.hidden, SHAPE.heads

    def accounting(recompute: str) -> float:
        return layer_activation_bytes(s, 1, h, a, attention=attention,  # type: ignore[arg-type]
                                      recompute=recompute,  # type: ignore[arg-type]
                                      t=t, sequence_parallel=sequence_parallel)

    assert block.held(t) == pytest.approx(accounting("none"), rel=1e-12)
    assert block.held_selective(t) == pytest.approx(accounting("selective"), rel=1e-12)
    # the layer's input: whole on every tp rank, or its 1/t under sequence parallelism
    assert block.kept_input(t) == pytest.approx(accounting("full"), rel=1e-12)


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_a_stages_memory_under_partial_recomputation_is_k_inputs_and_the_rest_whole(
        k: int) -> None:
    layers = transformer_profile(SHAPE, "bf16", attention="eager").layers
    table = StageTable.build(layers, [0, 1, 5, len(layers)], CLUSTER, "bf16", 2, "full", k)
    block = layers[1]
    recomputed = 4 if k == 0 else k  # the middle stage holds blocks 1-4
    expected = recomputed * block.input_bytes + (4 - recomputed) * block.held(2)
    assert table.held[1] == pytest.approx(expected)
    assert table.workspace[1] == pytest.approx(block.held(2))  # one layer alive again
    none = StageTable.build(layers, [0, 1, 5, len(layers)], CLUSTER, "bf16", 2, "none")
    assert none.workspace[1] == 0 and none.held[1] == pytest.approx(4 * block.held(2))


def test_recomputation_seconds_below_full_for_selective_and_partial() -> None:
    layers = transformer_profile(SHAPE, "bf16", attention="eager").layers
    cuts = [0, 5, len(layers)]
    again = {mode: StageTable.build(layers, cuts, CLUSTER, "bf16", 1, *mode).costs(2).recompute
             for mode in (("none", 0), ("selective", 0), ("full", 2), ("full", 0))}
    forward = StageTable.build(layers, cuts, CLUSTER, "bf16", 1, "none").costs(2).forward
    assert (again[("none", 0)] == 0).all()
    assert (0 < again[("selective", 0)]).all()
    assert (again[("selective", 0)] < again[("full", 0)]).all()
    assert (again[("full", 2)] < again[("full", 0)]).all()
    # full recomputation redoes the stage's forward (one more forward op)
    assert again[("full", 0)] == pytest.approx(forward)


def _priced(recompute: str, k: int = 0) -> tuple[float, float]:
    config = PlanConfig(pp=2, tp=1, dp=4, schedule="1f1b", chunks=1, microbatch_size=1,
                        num_microbatches=8, zero_stage=0, recompute=recompute,
                        recompute_layers=k)
    model = transformer_profile(SHAPE, "bf16", attention="eager")
    prediction = price(model, CLUSTER, 32, config)
    return prediction.memory.total, prediction.step_seconds


def test_selective_is_picked_where_keeping_everything_does_not_fit_but_selective_does(
        ) -> None:
    (none_mem, none_time), (sel_mem, sel_time), (full_mem, full_time) = (
        _priced("none"), _priced("selective"), _priced("full"))
    assert full_mem < sel_mem < none_mem and none_time < sel_time < full_time
    model = transformer_profile(SHAPE, "bf16", attention="eager")
    options = SearchOptions(pipeline_parallel=(2,), tensor_parallel=(1,), data_parallel=(4,),
                            microbatch_sizes=(1,), schedules=("1f1b",), zero_stages=(0,),
                            top=1000)
    for memory, picked in (((sel_mem + none_mem) / 2, ("selective", 0)),
                           (none_mem * 1.01, ("none", 0))):
        best = plan(model, replace(CLUSTER, device_memory=memory), 32, options=options).best
        assert (best.config.recompute, best.config.recompute_layers) == picked
    # between full and selective only full or partial-k fit: partial if one of its k does
    partial = [_priced("full", k) for k in (1, 2, 3)]
    memory = (full_mem + sel_mem) / 2
    best = plan(model, replace(CLUSTER, device_memory=memory), 32, options=options).best
    assert best.config.recompute == "full"
    fitting = [(time, k) for k, (mem, time) in zip((1, 2, 3), partial) if mem <= memory]
    if fitting:  # the fastest fitting k of the ¼, ½, ¾ of 5 layers the search tries
        assert best.config.recompute_layers in (1, 2, 3) and best.config.recompute_layers > 0


def test_filters_restrict_the_modes_searched() -> None:
    model = transformer_profile(SHAPE, "bf16", attention="eager")
    options = SearchOptions(pipeline_parallel=(2,), tensor_parallel=(1,), data_parallel=(4,),
                            microbatch_sizes=(1,), schedules=("1f1b",), zero_stages=(0,),
                            recompute_choices=("selective", "partial"), top=1000)
    result = plan(model, CLUSTER, 32, options=options)
    modes = {(p.config.recompute, p.config.recompute_layers) for p in result.predictions}
    assert modes and all(mode == ("selective", 0) or (mode[0] == "full" and mode[1] > 0)
                         for mode in modes)
    with pytest.raises(PlanError, match="recompute_choices"):
        SearchOptions(recompute_choices=("sometimes",))


def test_price_syntax_and_engine_arguments_of_each_mode() -> None:
    for text, mode, k in (("pp2,tp1,1f1b", "none", 0), ("pp2,tp1,rs", "selective", 0),
                          ("pp2,tp1,rc", "full", 0), ("pp2,tp1,rc3", "full", 3)):
        config = parse_config(text, 8, 32)
        assert (config.recompute, config.recompute_layers) == (mode, k)
        arguments = config.engine_arguments()
        assert arguments["recompute"] == mode
        assert arguments["recompute_layers"] == (k or None)
    assert parse_config("pp2,tp1,rc3", 8, 32).label().endswith("rc3")
    with pytest.raises(PlanError, match="recompute_layers"):
        PlanConfig(pp=2, tp=1, dp=4, schedule="1f1b", chunks=1, microbatch_size=1,
                   num_microbatches=8, zero_stage=0, recompute="none", recompute_layers=2)
