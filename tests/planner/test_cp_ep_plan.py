"""Context × expert parallelism in the planner (issue 48 item 4): ep carved from dp × cp as
the engine carves it (`Topology`: replica = dp_rank·cp + cp_rank), each cp rank routing its
own s/cp tokens. Each price against its definition written here (tokens and rows per rank,
the bytes of each all-to-all, the expert gradients' group, parameters per rank), the search
holding cp × ep points, and refusals in one line."""

from __future__ import annotations

import math
from dataclasses import replace
from itertools import pairwise

import numpy as np
import pytest

import pipeline.planner.expert_kernels as expert_kernels
from pipeline.cli import main
from pipeline.parallel.topology import Topology
from pipeline.planner import PRESETS, PlanConfig, PlanError, SearchOptions, load_model
from pipeline.planner.expert_parallel import all_to_all_seconds, expert_all_to_all
from pipeline.planner.grid import configurations
from pipeline.planner.kernels import LayerShape
from pipeline.planner.predict import PlanContext
from pipeline.planner.pricing import allreduce_seconds
from pipeline.planner.routing_load import busiest_rank_ratio
from pipeline.planner.tied import stage_params

__all__: list[str] = []

H100 = replace(PRESETS["h100-80g"], nodes=2)
MOE = ("layers=4,hidden=1024,heads=8,vocab=1000,seq=1024,mlp=swiglu,norm=rmsnorm,bias=none,"
       "learned_positions=false,ffn=4096,experts=8,topk=2,expert_ffn=2048")
SEQ, HIDDEN, TOPK, EXPERTS = 1024, 1024, 2, 8


def _config(*, dp: int, cp: int, ep: int, tp: int = 1, zero: int = 0) -> PlanConfig:
    return PlanConfig(pp=1, tp=tp, dp=dp, cp=cp, schedule="1f1b", chunks=1,
                      microbatch_size=2, num_microbatches=4, zero_stage=zero,
                      recompute="none", ep=ep)


def _block(**routed: object) -> LayerShape:
    shape = load_model(MOE, sequence_parallel=True).layers[1].shape
    assert shape is not None and shape.routed is not None
    return replace(shape, routed=replace(shape.routed, **routed))


@pytest.mark.parametrize(("tp", "cp"), [(1, 2), (2, 2), (1, 4), (2, 8)])
def test_a_rank_routes_its_own_sequence_slice(tp: int, cp: int) -> None:
    # n = b·s/(t·cp): the cp rank's 2 of 2·cp chunks, its tp rank's 1/t of them
    assert expert_kernels.rank_tokens(_block(cp=cp), 3, tp) == math.ceil(3 * SEQ / (tp * cp))


@pytest.mark.parametrize(("cp", "ep", "sets"), [(2, 2, 1), (2, 4, 1), (4, 2, 2), (2, 1, 1)])
def test_the_moe_mlp_is_the_cp_ranks_own_tokens_times_cp(cp: int, ep: int, sets: int) -> None:
    """The stage table divides every layer by cp: the MoE MLP's price there is cp × the
    rank's own, which is the MLP of a sequence of s/cp tokens at cp 1 (the same rows), its
    busiest rank waited on by the ep groups a replica's cp ranks fall into (`sets`)."""
    tp = 1
    priced = expert_kernels.moe_mlp_times(_block(cp=cp, ep=ep), 2, tp, H100, "bf16")
    alone = replace(_block(ep=ep), seq=SEQ // cp)
    if sets > 1:  # the cp/ep ep groups of one replica's cp ranks: the busiest of their busiest
        ratio = busiest_rank_ratio(2 * SEQ // cp, TOPK, EXPERTS, ep, sets)
        assert alone.routed is not None
        alone = replace(alone, routed=replace(alone.routed, imbalance=ratio))
    own = expert_kernels.moe_mlp_times(alone, 2, tp, H100, "bf16")
    assert priced == pytest.approx(tuple(cp * x for x in own), rel=1e-12)


def _ep_stride(topology: Topology) -> int:
    """The distance in the rank order between an ep group's neighbours, from the engine's
    own groups (all must agree)."""
    strides = {b - a for group in topology.all_ep_groups() for a, b in pairwise(group)}
    assert len(strides) == 1, strides
    return strides.pop()


@pytest.mark.parametrize(("tp", "dp", "cp", "ep"), [(1, 2, 4, 2), (1, 1, 8, 4), (2, 2, 2, 4),
                                                    (1, 4, 2, 8)])
def test_all_to_all_sends_the_cp_ranks_tokens_over_consecutive_replicas(
        tp: int, dp: int, cp: int, ep: int) -> None:
    model = load_model(MOE, sequence_parallel=True)
    config = _config(dp=dp, cp=cp, ep=ep, tp=tp)
    table = PlanContext(model, H100, 16, "bf16").table(config)
    found = expert_all_to_all(table, H100, batch=2, ep=ep, tp=tp)
    assert found is not None
    stride = _ep_stride(Topology(pp=1, dp=dp, tp=tp, ep=ep, cp=cp))
    tokens = 2 * SEQ // (tp * cp)  # the rank's own b·s/(t·cp)
    sets = tp * cp // math.gcd(cp, ep)
    nbytes = tokens * TOPK * HIDDEN * 2 * busiest_rank_ratio(tokens, TOPK, EXPERTS, ep, sets)
    # dispatch and combine, per MoE block (all 4 of them), forward and backward alike
    expected = 4 * 2 * all_to_all_seconds(nbytes, ep, stride, H100)
    assert np.allclose(found.forward, [expected], rtol=1e-12)
    assert np.allclose(found.backward, [expected], rtol=1e-12)


@pytest.mark.parametrize(("dp", "cp", "ep", "zero"), [(2, 2, 4, 0), (2, 4, 2, 1), (1, 4, 4, 1)])
def test_expert_gradients_and_states_over_the_ranks_holding_the_same_experts(
        dp: int, cp: int, ep: int, zero: int) -> None:
    model = load_model(MOE, sequence_parallel=True)
    context = PlanContext(model, H100, 16, "bf16")
    config = _config(dp=dp, cp=cp, ep=ep, zero=zero)
    table = context.table(config)
    topology = Topology(pp=1, dp=dp, tp=1, ep=ep, cp=cp)
    group = topology.position(0).expert_dp_group
    assert len(group) == dp * cp // ep  # t·dp·cp/ep at t = 1
    reduction = context._reduction(config, table)
    assert reduction is not None
    dense = stage_params(table, (0,)) - table.tied
    experts = table.experts / ep
    stride = group[1] - group[0] if len(group) > 1 else 1
    expected = allreduce_seconds(4 * dense[0], dp * cp, 1, H100) + (
        allreduce_seconds(4 * experts[0], len(group), stride, H100) if len(group) > 1 else 0)
    if not zero:
        assert reduction.time == pytest.approx([expected], rel=1e-12)
    memory, _ = context.memory(config, context.held_trace(config))
    whole = float(stage_params(table, (0,))[0])
    # fp32 weights of the dense part and 1/ep of the experts; Adam's 8 bytes sharded by
    # ZeRO-1 over dp·cp (dense) and the expert group (experts)
    assert memory.parameters == pytest.approx(4 * (whole + experts[0]), rel=1e-12)
    assert memory.optimizer == pytest.approx(
        8 * whole / (dp * cp if zero else 1) + 8 * experts[0] / (len(group) if zero else 1),
        rel=1e-12)


def test_the_search_holds_cp_times_ep_points() -> None:
    model = load_model(MOE, sequence_parallel=True)
    cluster = replace(H100, nodes=1)
    found = {(c.dp, c.cp, c.ep) for c in configurations(
        model, cluster, 8, SearchOptions(context_parallel=(1, 2, 4), recompute=False))}
    # ep dividing dp·cp but not dp: carved across the cp ranks
    assert {(1, 4, 4), (2, 4, 8), (1, 2, 2), (2, 2, 4)} <= found
    assert all((dp * cp) % ep == 0 and EXPERTS % ep == 0 for dp, cp, ep in found)


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"dp": 2, "cp": 2, "ep": 8}, "dividing dp=2 × cp=2 = 4"),
    ({"dp": 2, "cp": 1, "ep": 4}, "dividing dp=2 "),
])
def test_an_ep_that_does_not_divide_dp_cp_is_refused(kwargs: dict[str, int], words: str
                                                     ) -> None:
    with pytest.raises(PlanError, match=words) as caught:
        _config(**kwargs)
    assert "\n" not in str(caught.value)


def test_price_cp_with_ep_prints_the_engines_arguments(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    assert main(["plan", "--model", "layers=8,hidden=1024,heads=16,vocab=32000,seq=4096,"
                 "experts=8,topk=2,expert_ffn=2048,bias=none", "--cluster", "h100-80g",
                 "--nodes", "2", "--global-batch", "64", "--price", "pp2,dp4,cp2,ep2,b1"]) == 0
    out = capsys.readouterr().out
    assert "pp2 tp1 dp4 cp2 ep2 1f1b" in out
    assert "expert_parallel=2, context_parallel=2" in out


def test_planted_bug_routing_the_whole_sequence_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def whole(shape: LayerShape, batch: int, tp: int) -> int:  # forgets cp
        return math.ceil(batch * shape.seq / tp)

    monkeypatch.setattr(expert_kernels, "rank_tokens", whole)
    with pytest.raises(AssertionError):
        test_the_moe_mlp_is_the_cp_ranks_own_tokens_times_cp(2, 2, 1)


def test_the_train_line_carries_the_cp_and_ep_flags_train_accepts(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The printed `pipesched train` flags for an ep carved across cp ranks (ep 4 over dp 2
    × cp 2): the command's own check of them passes (refused only for the missing recipe,
    which the line names), where it once required ep to divide dp alone."""
    assert main(["plan", "--model", "layers=8,hidden=1024,heads=16,vocab=32000,seq=4096,"
                 "experts=8,topk=2,expert_ffn=2048,bias=none", "--cluster", "h100-80g",
                 "--nodes", "2", "--global-batch", "64", "--price", "pp4,dp2,cp2,ep4,b1"]) == 0
    line = next(text for text in capsys.readouterr().out.splitlines()
                if "pipesched train" in text)
    assert "--data-parallel 2 --batch-size 64 --cp 2 --expert-parallel 4" in line
    assert "--model MODULE:FUNCTION" in line
    flags = line.split("pipesched train ")[1].split("   #")[0].split()
    recipe = ["--model", "examples/hf_moe_recipe.py:build", "--steps", "1"]
    assert main(["train", *flags, *recipe]) == 2  # past the ep check: the recipe has no cp
    err = capsys.readouterr().err
    assert "must divide" not in err and "has no check_context_parallel" in err, err
    assert main(["train", *flags, "--cp", "1", *recipe]) == 2
    err = capsys.readouterr().err
    assert "--expert-parallel 4 must divide --data-parallel 2 (the experts" in err, err
