"""The planner's ZeRO-3 expert states (`memory.peak_rank_memory`: dense over dp, a rank's
experts over dp / ep) against the bytes the engine holds after an Adam step of a tiny
Mixtral at dp 4 × ep 2 (`count_model_states`), and a planted bug that fails."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.support.rank_harness import run_ranks

__all__: list[str] = []


def _counted_over_planned(planted: bool) -> float:
    """One Adam step at ZeRO-3, dp 4, ep 2: this rank's counted model-state bytes over the
    planner's parameters + gradients + optimizer (`planted`: the experts' states priced as
    sharded over all of dp)."""
    from pipeline import PipelineEngine, PipelineModule
    from pipeline.interop.hf_layers import causal_lm_targets, layers_from_hf
    from pipeline.moe.balance_loss import train_batch_balanced
    from pipeline.parallel.model_state import count_model_states
    from pipeline.planner import memory
    from tests.planner.test_zero_context_experts import _experts_over_dp
    from tests.support.hf_models import token_batch
    from tests.support.hf_moe_models import tiny_moe_config, tiny_moe_model

    hf = layers_from_hf(tiny_moe_config("mixtral"))
    module = PipelineModule(hf.layers, num_stages=1, loss_fn=hf.loss_fn)
    engine = PipelineEngine(module, schedule="1f1b", num_microbatches=2, data_parallel=4,
                            expert_parallel=2, zero_stage=3, timeout=60,
                            optimizer=lambda p: torch.optim.Adam(p, lr=1e-3))
    ids, _ = token_batch(4, 8, seed=dist.get_rank())
    train_batch_balanced(engine, hf.balance, ids, causal_lm_targets(ids))
    counted = count_model_states(module, engine.optimizer).total
    # the model's parameter counts from the config and HF's model (independent of the engine)
    config = hf.config
    experts = config.num_hidden_layers * config.num_local_experts * 3 * (
        config.hidden_size * config.intermediate_size)
    everything = sum(p.numel() for p in tiny_moe_model("mixtral").parameters())
    honest = memory.expert_state_bytes
    if planted:
        memory.expert_state_bytes = _experts_over_dp  # type: ignore[assignment]
    try:
        planned, _ = memory.peak_rank_memory(
            [everything - experts], [0.0], [0.0], [0], dp=4, zero=3, recompute=False,
            stage_expert_params=[experts], expert_parallel=2)
    finally:
        memory.expert_state_bytes = honest
    return counted / (planned.parameters + planned.gradients + planned.optimizer)


def _check(rank: int, world_size: int) -> None:
    torch.set_num_threads(1)
    ratio = _counted_over_planned(planted=False)
    # Adam's 4-byte step counter per stepped tensor is the only unpriced part
    assert abs(ratio - 1) <= 0.005, ratio
    assert abs(_counted_over_planned(planted=True) - 1) > 0.05


@pytest.mark.multiprocess
def test_zero_3_expert_states_equal_the_engines_counted_bytes() -> None:
    run_ranks(_check, 4, timeout=400)
