"""Expert parallelism: the ep dimension of the grid against a brute-force oracle, its
refusals before any rank starts, and tiny HF MoE models stepping as HF does at ep = 2 and 4."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from pipeline.errors import PipelineConfigError
from pipeline.moe import expert_parallel
from pipeline.moe.expert_parallel import expert_parallel_problem
from pipeline.parallel.config import ParallelConfig
from pipeline.parallel.topology import Topology, TopologyError
from schedules.analysis.accounting import expert_parallel_state_bytes
from tests.support.rank_harness import run_ranks


@pytest.mark.parametrize(("pp", "dp", "tp", "ep"), [(1, 4, 1, 2), (2, 4, 1, 4), (2, 4, 2, 2),
                                                     (1, 6, 1, 3), (2, 2, 1, 1)])
def test_ep_groups_match_their_definition(pp: int, dp: int, tp: int, ep: int) -> None:
    """Oracle from the definition: an ep group is ep consecutive dp replicas of one stage and
    tp shard; the expert-dp group holds the replicas with the same dp_rank mod ep."""
    topology = Topology(pp, dp, tp, ep)
    grid = {(k, d, t): (k * dp + d) * tp + t
            for k, d, t in itertools.product(range(pp), range(dp), range(tp))}
    for (k, d, t), rank in grid.items():
        position = topology.position(rank)
        block = d // ep
        assert position.ep_rank == d % ep
        assert set(position.ep_group) == {grid[k, block * ep + e, t] for e in range(ep)}
        assert set(position.expert_dp_group) == {grid[k, x, t] for x in range(dp)
                                                 if x % ep == d % ep}
        assert rank in position.ep_group and rank in position.expert_dp_group
    for groups in (topology.all_ep_groups(), topology.all_expert_dp_groups()):
        members = sorted(r for group in groups for r in group)
        assert members == list(range(topology.world_size))  # a partition of the world


def test_ep_not_dividing_dp_is_one_line_before_ranks_start() -> None:
    with pytest.raises(TopologyError, match=r"ep=3 must divide .* dp=4.*\[1, 2, 4\]") as raised:
        Topology(1, 4, 1, 3)
    assert "\n" not in str(raised.value)
    with pytest.raises(PipelineConfigError, match=r"expert_parallel=3 must divide "
                                                  r"data_parallel=4") as refused:
        ParallelConfig(data_parallel=4, expert_parallel=3)
    assert "\n" not in str(refused.value)


def test_built_layers_are_checked_against_ep_in_one_line() -> None:
    """`check_expert_layers` (the CLI's check of a --model's layers before any rank): no MoE
    layer at ep > 1, and experts ep does not divide, are refused; fitting ones pass."""
    from pipeline.moe.expert_parallel import check_expert_layers
    from pipeline.moe.layer import MoEFeedForward, RouterConfig

    def moe(experts: int) -> torch.nn.Module:
        config = RouterConfig(num_experts=experts, top_k=2, normalize_top_k=True)
        return torch.nn.Sequential(MoEFeedForward(config, torch.nn.Linear(4, experts),
                                                  torch.nn.Module()))

    check_expert_layers([torch.nn.Linear(2, 2), moe(4)], 2)
    check_expert_layers([torch.nn.Linear(2, 2)], 1)
    with pytest.raises(PipelineConfigError, match=r"expert_parallel=2 but the model has no "
                                                  r"MoE layers"):
        check_expert_layers([torch.nn.Linear(2, 2)], 2)
    with pytest.raises(PipelineConfigError, match=r"expert_parallel=4 must divide the 6 "
                                                  r"experts") as refused:
        check_expert_layers([moe(4), moe(6)], 4)
    assert "\n" not in str(refused.value)


def test_ep_not_dividing_the_experts_and_top_k_above_them_are_named() -> None:
    assert expert_parallel_problem(8, 2, 4) is None
    assert "must divide the 6 experts" in str(expert_parallel_problem(6, 2, 4))
    assert "top_k 7 must be in 1..6" in str(expert_parallel_problem(6, 7, 2))


def _source_major_order(matrix: torch.Tensor) -> torch.Tensor:
    """Planted bug: received rows left in (source, expert) order, so an expert computes rows
    that were sent to its neighbour."""
    return torch.arange(int(matrix.sum()))


def _experts_sharded_over_dp(dense: int, experts: int, **options: Any) -> float:
    """Planted bug: the experts' optimizer state priced as sharded over all of dp."""
    options["expert_parallel"] = 1
    return expert_parallel_state_bytes(dense, experts // 2, **options)


def _check_expert_parallel(rank: int, world_size: int) -> None:
    from tests.interop.test_hf_moe import _planted, _within
    from tests.support.hf_moe_equivalence import moe_step_differences
    from tests.support.moe_state_counts import mixtral_states_after_a_step

    torch.set_num_threads(1)
    cases = [("mixtral", 1, 4, 4, False), ("qwen2_moe", 2, 2, 2, True),
             ("qwen3_moe", 1, 4, 2, True)]
    for family, pp, dp, ep, zero in cases:
        found = moe_step_differences(family, pp=pp, dp=dp, ep=ep, zero=zero)
        assert _within(found), (family, pp, dp, ep, zero, found)
    # top-1 over tied routers: expert 3, alone on ep rank 3, gets no token
    found = moe_step_differences("mixtral", pp=1, dp=4, ep=4, top_k=1, ties=True)
    assert _within(found), found
    # one Adam step of tiny Mixtral at dp 4 × ep 2, ZeRO-1: counted bytes over the accounting
    counted, dense, experts = mixtral_states_after_a_step(zero_stage=1)
    options: dict[str, Any] = {"expert_parallel": 2, "data_parallel": 4, "zero_stage": 1}
    ratio = counted / expert_parallel_state_bytes(dense, experts, **options)
    assert abs(ratio - 1) <= 0.02, ratio
    assert abs(counted / _experts_sharded_over_dp(dense, experts, **options) - 1) > 0.02
    with _planted("wrong expert in the combine"):
        found = moe_step_differences("mixtral", pp=1, dp=4, ep=2)
    assert not _within(found), found
    saved = expert_parallel.expert_major_order
    expert_parallel.expert_major_order = _source_major_order
    try:
        found = moe_step_differences("mixtral", pp=1, dp=4, ep=2)
    finally:
        expert_parallel.expert_major_order = saved
    assert not _within(found), found


@pytest.mark.multiprocess
@pytest.mark.slow
def test_expert_parallel_steps_equal_hf() -> None:
    """Mixtral at ep=4 (dp=4), Qwen2-MoE at pp=2 × dp=2 × ep=2 with ZeRO-1, Qwen3-MoE at
    ep=2 of dp=4 with ZeRO-1 (expert gradients reduce-scattered over a 2-rank expert-dp
    group, dense ones over dp): loss, gradients (each rank's
    expert shard against HF's rows) and weights after a step (gathered back to HF names)
    within 1e-5 of HF's; an idle expert alone on its rank; planted wrong experts (in the
    expert computation, and in regrouping the received rows) fail. Counted expert + dense
    model-state bytes per rank (Adam, ZeRO-1) within 2 % of the accounting's prediction,
    which fails when it shards the experts' state over all of dp."""
    run_ranks(_check_expert_parallel, 4, timeout=400)
