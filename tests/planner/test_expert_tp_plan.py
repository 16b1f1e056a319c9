"""Expert tensor parallelism = tp in the planner (issue 48 item 4; the engine's
`expert_tensor_parallel`, `pipeline.moe.expert_tensor_parallel`): each expert's GEMMs 1/t of
f_e wide on the tp group's gathered rows, the rows all-gathered and the partial outputs
reduce-scattered over tp, forward and backward, the experts' parameters over tp · ep. Each
price against its definition written here; refusals in one line; a planted bug."""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise

import numpy as np
import pytest

import pipeline.planner.pricing as pricing
from pipeline.cli import main
from pipeline.parallel.topology import Topology
from pipeline.planner import (
    PRESETS,
    PlanConfig,
    PlanError,
    SearchOptions,
    load_model,
    plan,
    resolve_cluster,
)
from pipeline.planner.expert_kernels import expert_gemm_times, gathered_rows
from pipeline.planner.expert_parallel import expert_all_to_all, expert_group
from pipeline.planner.host_launch import pass_collective_calls
from pipeline.planner.kernels import LayerShape
from pipeline.planner.predict import PlanContext
from pipeline.planner.pricing import allgather_seconds, expert_tp_seconds, reduce_scatter_seconds
from pipeline.planner.routing_load import busiest_rank_ratio
from pipeline.planner.tied import stage_params

__all__: list[str] = []

H100 = replace(PRESETS["h100-80g"], nodes=2)
MOE = ("layers=4,hidden=1024,heads=8,vocab=1000,seq=1024,mlp=swiglu,norm=rmsnorm,bias=none,"
       "learned_positions=false,ffn=4096,experts=8,topk=2,expert_ffn=2048")
SEQ, HIDDEN, TOPK, EXPERTS, EXPERT_FFN = 1024, 1024, 2, 8, 2048


def _block(**routed: object) -> LayerShape:
    shape = load_model(MOE, sequence_parallel=True).layers[1].shape
    assert shape is not None and shape.routed is not None
    return replace(shape, routed=replace(shape.routed, **routed))


def _config(*, tp: int, dp: int, ep: int, zero: int = 0) -> PlanConfig:
    return PlanConfig(pp=1, tp=tp, dp=dp, schedule="1f1b", chunks=1, microbatch_size=2,
                      num_microbatches=4, zero_stage=zero, recompute="none", ep=ep)


@pytest.mark.parametrize(("tp", "ep"), [(2, 2), (4, 2), (2, 8), (4, 1)])
def test_the_tp_group_gathers_its_ranks_rows(tp: int, ep: int) -> None:
    # each tp rank routes its own n = b·s/t tokens through its own ep group; ep rank j's tp
    # group runs the t ranks' rows of its experts: a load of the t·ep·n tokens' pool
    n = 2 * SEQ // tp
    expected = tp * n * TOPK * (busiest_rank_ratio(tp * n, TOPK, EXPERTS, ep, 1)
                                if ep > 1 else 1.0)
    assert gathered_rows(_block(ep=ep, expert_tp=tp), 2, tp) == pytest.approx(expected,
                                                                              rel=1e-12)


@pytest.mark.parametrize(("tp", "ep"), [(2, 2), (4, 2), (2, 1)])
def test_each_expert_runs_1_over_t_of_its_width_on_the_gathered_rows(tp: int, ep: int
                                                                     ) -> None:
    # the same GEMMs as experts f_e/t wide on the rows the whole b·s tokens route (at tp 1)
    split = expert_gemm_times(_block(ep=ep, expert_tp=tp), 2, tp, H100, "bf16")
    narrow = expert_gemm_times(_block(ep=ep, expert_ffn=EXPERT_FFN // tp), 2, 1, H100, "bf16")
    assert split == pytest.approx(narrow, rel=1e-12)
    assert split != pytest.approx(expert_gemm_times(_block(ep=ep), 2, tp, H100, "bf16"))


@pytest.mark.parametrize(("tp", "ep"), [(2, 2), (4, 2), (8, 1)])
def test_the_gather_and_reduce_scatter_move_the_gathered_rows(tp: int, ep: int) -> None:
    layer = load_model(MOE, sequence_parallel=True).layers[1]
    assert layer.shape is not None and layer.shape.routed is not None
    layer = replace(layer, shape=_block(ep=ep, expert_tp=tp))
    n = 2 * SEQ // tp
    rows = tp * n * TOPK * (busiest_rank_ratio(tp * n, TOPK, EXPERTS, ep, 1) if ep > 1 else 1)
    nbytes = rows * HIDDEN * 2  # bf16 rows of h
    pair = allgather_seconds(nbytes, tp, 1, H100) + reduce_scatter_seconds(nbytes, tp, 1, H100)
    counts = allgather_seconds(8 * EXPERTS // ep * tp, tp, 1, H100)  # int64 row counts
    forward, backward = expert_tp_seconds(layer, H100, 2, tp)
    assert forward == pytest.approx(pair + counts, rel=1e-12)
    assert backward == pytest.approx(pair, rel=1e-12)
    # at expert tp 1: none
    assert expert_tp_seconds(replace(layer, shape=_block(ep=ep)), H100, 2, tp) == (0.0, 0.0)


def _context(etp: bool) -> PlanContext:
    return PlanContext(load_model(MOE, sequence_parallel=True), H100, 16, "bf16",
                       expert_tensor_parallel=etp)


def test_the_all_to_all_is_the_ranks_own_tokens_at_any_expert_tp() -> None:
    config = _config(tp=2, dp=8, ep=4)
    found = [expert_all_to_all(_context(etp).table(config), H100, batch=2, ep=4, tp=2)
             for etp in (False, True)]
    assert found[0] is not None and found[1] is not None
    assert np.allclose(found[0].forward, found[1].forward, rtol=1e-12)


@pytest.mark.parametrize(("tp", "dp", "ep", "zero"), [(2, 8, 4, 1), (4, 4, 2, 1), (2, 4, 1, 0)])
def test_experts_are_held_over_tp_times_ep_and_reduced_over_their_shards_group(
        tp: int, dp: int, ep: int, zero: int) -> None:
    context = _context(True)
    config = _config(tp=tp, dp=dp, ep=ep, zero=zero)
    table = context.table(config)
    dense = float(stage_params(table, (0,))[0])
    experts = float(table.experts[0]) / (tp * ep)  # this rank's shard of the E experts
    memory, _ = context.memory(config, context.held_trace(config))
    # the ranks holding the same shard: same tp rank, same ep rank, dp / ep of them
    group = Topology(pp=1, dp=dp, tp=tp, ep=ep).position(0).expert_dp_group
    assert len(group) == dp // ep
    assert expert_group(dp, tp, context.expert_shards(config)) == (
        len(group), (group[1] - group[0]) if len(group) > 1 else tp * ep)
    assert memory.parameters == pytest.approx(4 * (dense + experts), rel=1e-12)
    assert memory.optimizer == pytest.approx(
        8 * dense / (dp if zero else 1) + 8 * experts / (len(group) if zero else 1), rel=1e-12)


def test_expert_tp_without_experts_is_refused_in_one_line() -> None:
    dense = load_model("layers=4,hidden=1024,heads=8,vocab=1000,seq=1024")
    with pytest.raises(PlanError, match="no experts to split over tp") as caught:
        plan(dense, resolve_cluster("h100-80g", nodes=1), 8,
             options=SearchOptions(expert_tensor_parallel=True))
    assert "\n" not in str(caught.value)


def test_a_tp_that_does_not_divide_the_expert_width_is_refused_or_skipped() -> None:
    odd = load_model(MOE.replace("expert_ffn=2048", "expert_ffn=1030"), sequence_parallel=True)
    cluster = resolve_cluster("h100-80g", nodes=1)
    with pytest.raises(PlanError, match=r"tensor-parallel size 4 \(expert_ffn 1030\)"):
        plan(odd, cluster, 8, options=SearchOptions(expert_tensor_parallel=True,
                                                    tensor_parallel=(4,)))
    searched = plan(odd, cluster, 8, options=SearchOptions(expert_tensor_parallel=True,
                                                           recompute=False, max_chunks=1))
    assert {p.config.tp for p in searched.predictions} <= {1, 2}


def test_the_printed_lines_carry_expert_tp(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", MOE, "--cluster", "h100-80g", "--nodes", "2", "--global-batch",
            "16", "--sequence-parallel", "--expert-tensor-parallel", "--price",
            "pp1,tp4,dp4,ep2,b2"]
    assert main(args) == 0
    assert "expert_parallel=2, expert_tensor_parallel=4" in capsys.readouterr().out
    assert main([*args, "--engine", "megatron-core"]) == 0
    assert "--expert-model-parallel-size 2 --expert-tensor-parallel-size 4" in \
        capsys.readouterr().out


def test_planted_bug_gathering_only_the_own_rows_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pricing, "gathered_rows",
                        lambda shape, batch, tp: gathered_rows(shape, batch, tp)
                        / shape.routed.expert_tp)
    with pytest.raises(AssertionError):
        test_the_gather_and_reduce_scatter_move_the_gathered_rows(2, 2)


def test_pairwise_groups_hold_one_stride() -> None:
    # the oracle above reads the stride off the engine's groups: they are evenly spaced
    for group in Topology(pp=1, dp=8, tp=2, ep=4).all_expert_dp_groups():
        assert len({b - a for a, b in pairwise(group)}) <= 1


def test_the_host_issues_the_tp_groups_three_and_two_more_calls() -> None:
    layer = load_model(MOE, sequence_parallel=True).layers[1]
    whole, split = (pass_collective_calls(replace(layer, shape=_block(ep=2, expert_tp=t)), 2)
                    for t in (1, 2))
    # forward: the counts' and the rows' all-gathers, the partials' reduce-scatter;
    # backward: the two adjoints
    assert (split[0] - whole[0], split[1] - whole[1]) == (3, 2)
    # at cp 2 a rank's own calls × 2: the stage table divides every layer by cp
    at_cp = pass_collective_calls(replace(layer, shape=_block(ep=2, expert_tp=2, cp=2)), 2)
    assert (at_cp[0] - whole[0], at_cp[1] - whole[1]) == (2 * 3 + 2, 2 * 2 + 2)
