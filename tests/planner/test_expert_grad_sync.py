"""This engine's MoE gradients at tp > 1 in the planner (`expert_grad_sync`), each price
against its definition written here: under ZeRO-2 / 3 the per-microbatch tp sum of every MoE
tensor's gradient inside the op computing it (B, or W when split), shown as tp_comm; under
ZeRO-0 / 1 one coalesced all-reduce of a stage's MoE gradients a step, exposed; the expert
group of the dp / ep ranks of one tp rank (the engine's `Topology.expert_dp_group`) for
the step's reduction; Megatron-Core's rule unchanged. Planted bugs fail the checks
(the engine's own counts: `test_tp_ep_engine_grads.py`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest

import pipeline.planner.data_parallel as data_parallel
import pipeline.planner.expert_grad_sync as expert_grad_sync
import pipeline.planner.rank_pricing as rank_pricing
from pipeline.parallel.topology import Topology
from pipeline.planner import PRESETS, PlanConfig, PlanError, SearchOptions, load_model
from pipeline.planner.engines import engine_options
from pipeline.planner.expert_grad_sync import engine_expert_group
from pipeline.planner.predict import PlanContext
from pipeline.planner.pricing import allreduce_seconds, reduce_scatter_seconds
from pipeline.planner.search import price

__all__: list[str] = []

H100 = PRESETS["h100-80g"]
H, E, F = 1024, 8, 4096
MOE = (f"layers=4,hidden={H},heads=8,vocab=1000,seq=512,mlp=swiglu,norm=rmsnorm,bias=none,"
       f"learned_positions=false,ffn={F},experts={E},topk=2,expert_ffn={F}")


def _config(tp: int = 2, ep: int = 2, dp: int = 4, zero: int = 1) -> PlanConfig:
    return PlanConfig(pp=1, tp=tp, dp=dp, schedule="1f1b", chunks=1, microbatch_size=2,
                      num_microbatches=4, zero_stage=zero, recompute="none", ep=ep)


def _hooks_seconds(tp: int, ep: int, cluster: object = H100) -> float:
    """One MoE block's backward in this engine, by definition: one synchronous all-reduce
    over the t neighbouring ranks of each fp32 gradient its hooks sum: the router (E·h),
    the rank's E/ep experts' gate-and-up (E/ep · 2f · h) and down (E/ep · h · f)."""
    return sum(allreduce_seconds(4 * count, tp, 1, cluster)  # type: ignore[arg-type]
               for count in (E * H, E // ep * 2 * F * H, E // ep * H * F))


@pytest.mark.parametrize(("dp", "cp", "tp", "ep"), [(4, 1, 2, 2), (8, 1, 4, 2), (2, 2, 2, 4),
                                                    (4, 1, 2, 1)])
def test_the_tp_rank_group_is_the_engines_expert_dp_group(dp: int, cp: int, tp: int,
                                                          ep: int) -> None:
    topology = Topology(pp=1, dp=dp, tp=tp, ep=ep, cp=cp)
    for rank in range(dp * cp * tp):
        members = topology.position(rank).expert_dp_group
        strides = set(np.diff(members).tolist()) or {tp * ep}
        assert engine_expert_group(dp * cp, tp, ep, "tp_rank") == (len(members),
                                                                    strides.pop())
    assert engine_expert_group(dp * cp, tp, ep, "megatron") == (tp * dp * cp // ep, ep)


def _step_seconds(tp: int, ep: int, blocks: int, cluster: object = H100) -> float:
    """ZeRO-0 / 1 with the engine's `overlap_grad_reduce`, by definition: once a step, one
    all-reduce over the t neighbouring ranks of the fp32 routers' gradients of all `blocks`
    MoE blocks of the stage (a dense bucket's), one of the experts' (E/ep · 3 · f · h each)."""
    return (allreduce_seconds(4 * blocks * E * H, tp, 1, cluster)  # type: ignore[arg-type]
            + allreduce_seconds(4 * blocks * E // ep * 3 * F * H, tp, 1,
                                cluster))  # type: ignore[arg-type]


def _check_backward() -> None:
    """Under ZeRO-2 each stage's backward carries the hooks' sums, in W (split) and B
    (fused), as tp_comm; ZeRO-0 / 1, Megatron-Core's rule and t = 1 none."""
    model = load_model(MOE, sequence_parallel=True)
    blocks = sum(1 for layer in model.layers if layer.expert_params)
    ours, core = (PlanContext(model, H100, 32, "bf16", expert_grad_group=rule)
                  for rule in ("tp_rank", "megatron"))
    for zero in (0, 1):
        assert np.array_equal(ours.table(_config(zero=zero)).costs(2).weight_grad,
                              core.table(_config(zero=zero)).costs(2).weight_grad)
    for split in (False, True):
        mine, theirs = (context.table(_config(zero=2)).costs(2, split)
                        for context in (ours, core))
        added = blocks * _hooks_seconds(2, 2)
        assert np.allclose(mine.weight_grad - theirs.weight_grad, added, rtol=1e-12, atol=0)
        assert np.allclose(mine.tp_comm - theirs.tp_comm, added, rtol=1e-12, atol=0)
        assert np.array_equal(mine.forward, theirs.forward)
        assert np.array_equal(mine.input_grad, theirs.input_grad)
    alone = ours.table(_config(tp=1, dp=8)).costs(2)
    assert np.array_equal(alone.weight_grad, core.table(_config(tp=1, dp=8)).costs(2).weight_grad)


def _check_reduction() -> None:
    """The step's reduction: the dense gradients over dp, the experts' over this engine's
    d / ep ranks of one tp rank, t·ep apart (ZeRO-1: reduce-scatters)."""
    cluster = replace(H100, nodes=2)
    model = load_model(MOE, sequence_parallel=True)
    config = _config(dp=8)
    context = PlanContext(model, cluster, 64, "bf16")
    table = context.table(config)
    found = context._reduction(config, table)
    assert found is not None
    expected = [reduce_scatter_seconds(4 * dense, 8, 2, cluster)
                + (reduce_scatter_seconds(4 * experts / 2, 4, 4, cluster) if experts else 0.0)
                for dense, experts in zip(table.params, table.experts, strict=True)]
    assert np.allclose(found.time, expected, rtol=1e-12)


def _check_step() -> None:
    """ZeRO-0 / 1: the rank's exposed seconds around the step carry one coalesced tp sum of
    its stage's MoE gradients (the engine's `PartialGradSums`), against the same step
    without it."""
    model = load_model(MOE, sequence_parallel=True)
    blocks = sum(1 for layer in model.layers if layer.expert_params)
    priced = rank_pricing.tp_gradient_step_seconds
    for zero in (0, 1):
        mine = PlanContext(model, H100, 32, "bf16").update_seconds(_config(zero=zero))[1]
        rank_pricing.tp_gradient_step_seconds = (  # type: ignore[assignment]
            lambda stages, *args, **kwargs: np.zeros(len(stages)))
        try:
            without = PlanContext(model, H100, 32, "bf16").update_seconds(_config(zero=zero))[1]
        finally:
            rank_pricing.tp_gradient_step_seconds = priced  # type: ignore[assignment]
        assert np.allclose(mine - without, _step_seconds(2, 2, blocks), rtol=1e-12, atol=0)
        core = PlanContext(model, H100, 32, "bf16", expert_grad_group="megatron")
        assert not np.any(core.table(_config(zero=zero)).costs(2).tp_comm
                          - PlanContext(model, H100, 32, "bf16").table(
                              _config(zero=zero)).costs(2).tp_comm)


CHECKS: tuple[Callable[[], None], ...] = (_check_backward, _check_reduction, _check_step)


def test_the_backward_and_the_step_price_this_engines_hooks_and_groups() -> None:
    for check in CHECKS:
        check()


def _without_router(layer: object, ep: int, *, split_experts: bool = False
                    ) -> tuple[float, ...]:
    return HONEST_TENSORS(layer, ep, split_experts=split_experts)[1:]  # type: ignore[arg-type]


def _one_all_reduce(stages: object, cluster: object, *, tp: int, ep: int,
                    gradient_bytes: float, split_experts: bool = False) -> np.ndarray:
    """Planted: a stage's MoE gradients summed in one all-reduce (one latency)."""
    return np.array([allreduce_seconds(gradient_bytes * sum(
        sum(HONEST_TENSORS(layer, ep)) for layer in stage), tp, 1, cluster)  # type: ignore
        for stage in stages])  # type: ignore[attr-defined]


def _per_tensor(stages: object, cluster: object, *, tp: int, ep: int, gradient_bytes: float,
                split_experts: bool = False, overlap: bool = False) -> np.ndarray:
    """Planted: the step's sum priced one all-reduce per tensor (the hooks' way)."""
    return expert_grad_sync.tp_gradient_sum_seconds(
        stages, cluster, tp=tp, ep=ep, gradient_bytes=gradient_bytes,  # type: ignore[arg-type]
        split_experts=split_experts)


def _coalesced(stages: object, cluster: object, **kwargs: object) -> np.ndarray:
    """Planted: one all-reduce a stage although the overlapped engine issues two."""
    kwargs["overlap"] = False
    return HONEST_STEP(stages, cluster, **kwargs)  # type: ignore[arg-type]


HONEST_STEP = expert_grad_sync.tp_gradient_step_seconds
HONEST_TENSORS = expert_grad_sync.moe_gradient_tensors
PLANTED: dict[str, tuple[object, str, object, Callable[[], None]]] = {
    "router not summed": (expert_grad_sync, "moe_gradient_tensors", _without_router,
                          _check_backward),
    "one all-reduce a stage": (rank_pricing, "tp_gradient_sum_seconds", _one_all_reduce,
                               _check_backward),
    "per tensor at the step": (rank_pricing, "tp_gradient_step_seconds", _per_tensor,
                               _check_step),
    "one all-reduce despite the overlap": (rank_pricing, "tp_gradient_step_seconds",
                                           _coalesced, _check_step),
    "Megatron-Core's group": (data_parallel, "engine_expert_group",
                              lambda dp, tp, ep, rule: engine_expert_group(dp, tp, ep,
                                                                           "megatron"),
                              _check_reduction),
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_planted_bugs_fail_the_checks(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    owner, name, replacement, check = PLANTED[bug]
    monkeypatch.setattr(owner, name, replacement)
    with pytest.raises(AssertionError):
        check()


def test_the_breakdown_books_the_hooks_as_tp_comm_and_megatron_core_is_unchanged() -> None:
    model = load_model(MOE, sequence_parallel=True)
    blocks = sum(1 for layer in model.layers if layer.expert_params)
    ours, core_rule = (price(model, H100, 32, _config(zero=2), options=SearchOptions(
        expert_grad_group=rule)) for rule in ("tp_rank", "megatron"))
    # ZeRO-2: m microbatches, each backward summing every block's MoE gradients
    assert ours.breakdown["tp_comm"] - core_rule.breakdown["tp_comm"] == pytest.approx(
        4 * blocks * _hooks_seconds(2, 2), rel=1e-9)
    assert sum(ours.breakdown.values()) == pytest.approx(ours.step_seconds, rel=1e-9)
    assert ours.step_seconds > core_rule.step_seconds
    ours, core_rule = (price(model, H100, 32, _config(), options=SearchOptions(
        expert_grad_group=rule)) for rule in ("tp_rank", "megatron"))
    # ZeRO-1: once a step, exposed around it (booked with dp_comm), none in the backward
    assert ours.breakdown["tp_comm"] == pytest.approx(core_rule.breakdown["tp_comm"], rel=1e-9)
    assert sum(ours.breakdown.values()) == pytest.approx(ours.step_seconds, rel=1e-9)
    # ZeRO-1: this engine shards the experts' Adam state over dp / ep = 2, not t·dp / ep = 4
    experts = sum(layer.expert_params for layer in model.layers) / 2
    assert ours.memory.optimizer - core_rule.memory.optimizer == pytest.approx(
        8 * experts / 2 - 8 * experts / 4, rel=1e-9)
    megatron = SearchOptions(**engine_options("megatron-core"))
    assert megatron.expert_grad_group == "megatron"


def test_an_unknown_rule_is_one_line() -> None:
    with pytest.raises(PlanError, match=r"expert_grad_group='tp' is not known; choose from "
                                        r"tp_rank, megatron"):
        SearchOptions(expert_grad_group="tp")


def test_with_experts_split_over_tp_only_the_router_is_summed_and_both_rules_agree() -> None:
    """Expert tensor parallelism: each tp rank holds its own slice of the experts, whose
    gradients the engine leaves unsummed (`hf_moe_tp`: a tensor-parallel shard keeps its own
    gradient); the router's is still summed every backward. So this engine's step is
    Megatron-Core's rule plus, per microbatch and block under ZeRO-2, the router's all-reduce
    alone (ZeRO-0 / 1: once a step), and
    the two rules hold the same expert states (sharded over the d / ep ranks with the same
    slice)."""
    model = load_model(MOE, sequence_parallel=True)
    blocks = sum(1 for layer in model.layers if layer.expert_params)
    ours, core = (price(model, H100, 32, _config(zero=2), options=SearchOptions(
        expert_tensor_parallel=True, expert_grad_group=rule)) for rule in ("tp_rank", "megatron"))
    router = allreduce_seconds(4 * E * H, 2, 1, H100)
    assert ours.breakdown["tp_comm"] - core.breakdown["tp_comm"] == pytest.approx(
        4 * blocks * router, rel=1e-6)
    ours, core = (price(model, H100, 32, _config(), options=SearchOptions(
        expert_tensor_parallel=True, expert_grad_group=rule)) for rule in ("tp_rank", "megatron"))
    assert ours.memory.optimizer == pytest.approx(core.memory.optimizer)
