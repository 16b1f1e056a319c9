"""Model-state bytes a rank holds after one Adam step of a tiny Mixtral at dp 4 × ep 2, with
the model's dense and expert parameter counts taken apart from the engine (test helper)."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["mixtral_states_after_a_step"]


def mixtral_states_after_a_step(zero_stage: int) -> tuple[int, int, int]:
    """(this rank's counted model-state bytes, the model's dense parameters, its expert
    parameters) after one 1F1B step (2 microbatches) of tiny Mixtral at dp 4 × ep 2 under
    ZeRO `zero_stage`. The counts come from the config and HF's own model, not the engine."""
    from pipeline import PipelineEngine, PipelineModule
    from pipeline.interop.hf_layers import causal_lm_targets, layers_from_hf
    from pipeline.moe.balance_loss import train_batch_balanced
    from pipeline.parallel.model_state import count_model_states
    from tests.support.hf_models import token_batch
    from tests.support.hf_moe_models import tiny_moe_config, tiny_moe_model

    hf = layers_from_hf(tiny_moe_config("mixtral"))
    module = PipelineModule(hf.layers, num_stages=1, loss_fn=hf.loss_fn)
    engine = PipelineEngine(module, schedule="1f1b", num_microbatches=2, data_parallel=4,
                            expert_parallel=2, zero_stage=zero_stage, timeout=60,
                            optimizer=lambda p: torch.optim.Adam(p, lr=1e-3))
    ids, _ = token_batch(4, 8, seed=dist.get_rank())
    train_batch_balanced(engine, hf.balance, ids, causal_lm_targets(ids))
    counted = count_model_states(module, engine.optimizer).total
    config = hf.config
    experts = config.num_hidden_layers * config.num_local_experts * 3 * (
        config.hidden_size * config.intermediate_size)
    everything = sum(p.numel() for p in tiny_moe_model("mixtral").parameters())
    return counted, everything - experts, experts
