"""The planner's ZeRO-3 expert states (`memory.peak_rank_memory`: dense over dp, a rank's
experts over dp / ep) against the bytes the engine holds after an Adam step of a tiny
Mixtral at dp 4 × ep 2 (`count_model_states`), and a planted bug that fails."""

from __future__ import annotations

import pytest
import torch

from tests.support.rank_harness import run_ranks

__all__: list[str] = []


def _planned_states(dense: int, experts: int, planted: bool) -> float:
    """The planner's parameters + gradients + optimizer bytes of a rank at ZeRO-3, dp 4,
    ep 2 (`planted`: the experts' states priced as sharded over all of dp)."""
    from pipeline.planner import memory
    from tests.planner.test_zero_context_experts import _experts_over_dp

    honest = memory.expert_state_bytes
    if planted:
        memory.expert_state_bytes = _experts_over_dp  # type: ignore[assignment]
    try:
        planned, _ = memory.peak_rank_memory(
            [dense], [0.0], [0.0], [0], dp=4, zero=3, recompute=False,
            stage_expert_params=[experts], expert_parallel=2)
    finally:
        memory.expert_state_bytes = honest
    return planned.parameters + planned.gradients + planned.optimizer


def _check(rank: int, world_size: int) -> None:
    from tests.support.moe_state_counts import mixtral_states_after_a_step

    torch.set_num_threads(1)
    counted, dense, experts = mixtral_states_after_a_step(zero_stage=3)  # one Adam step
    ratio = counted / _planned_states(dense, experts, planted=False)
    # Adam's 4-byte step counter per stepped tensor is the only unpriced part
    assert abs(ratio - 1) <= 0.005, ratio
    assert abs(counted / _planned_states(dense, experts, planted=True) - 1) > 0.05


@pytest.mark.multiprocess
def test_zero_3_expert_states_equal_the_engines_counted_bytes() -> None:
    run_ranks(_check, 4, timeout=400)
