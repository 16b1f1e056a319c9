"""HF mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) pipelined: one step equals
HF's, the load-balancing loss included; planted bugs in the combine and the balancing loss
fail the same comparison."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from pipeline.errors import PipelineConfigError
from pipeline.interop.hf_layers import layers_from_hf
from pipeline.moe import experts as experts_module
from pipeline.moe.balance_loss import BalanceLoss
from pipeline.moe.routing import RouterStatistics
from tests.support.hf_moe_equivalence import moe_step_differences
from tests.support.hf_moe_models import tiny_moe_config, tiny_moe_model
from tests.support.rank_harness import run_ranks

TOLERANCE = 1e-5


def _within(found: dict[str, Any]) -> bool:
    return all(found[k] <= TOLERANCE for k in ("loss", "grad", "param"))


def test_top_k_above_the_experts_is_one_line_before_any_rank() -> None:
    config = tiny_moe_config("mixtral")
    config.num_experts_per_tok = 5
    with pytest.raises(PipelineConfigError, match=r"top_k 5 must be in 1\.\.4"):
        layers_from_hf(config)


def test_ep_not_dividing_the_experts_is_one_line_before_any_rank() -> None:
    with pytest.raises(PipelineConfigError, match=r"expert_parallel=3 must divide the 4 "
                                                  r"experts.*\[1, 2, 4\]"):
        layers_from_hf(tiny_moe_config("qwen3_moe"), expert_parallel=3)


def test_router_jitter_with_the_balancing_loss_is_refused() -> None:
    config = tiny_moe_config("mixtral")
    config.router_jitter_noise = 0.1
    with pytest.raises(PipelineConfigError, match=r"router_jitter_noise.*census"):
        layers_from_hf(config)


def test_a_model_instance_points_to_its_config() -> None:
    with pytest.raises(PipelineConfigError, match=r"model\.config.*state_dict"):
        layers_from_hf(tiny_moe_model("mixtral"))


def test_plain_train_batch_is_refused_while_the_balancing_loss_is_on() -> None:
    """Without the census the layers do not know the step's expert counts: a forward says
    which call to use instead of training on a wrong loss."""
    hf = layers_from_hf(tiny_moe_config("qwen2_moe"))
    block = hf.layers[1].build()  # type: ignore[union-attr]
    value = (torch.randn(2, 4, 32), torch.zeros(1), torch.arange(4).unsqueeze(0))
    with pytest.raises(PipelineConfigError, match=r"train_batch_balanced"):
        block(value)


_HF_SHARE = BalanceLoss.share


def _per_microbatch_share(self: BalanceLoss, stats: RouterStatistics) -> torch.Tensor:
    """Planted bug: each microbatch's own Switch loss (its counts over its rows), averaged by
    the engine like any loss, instead of HF's one loss over the whole batch."""
    if self.phase == "census":
        return _HF_SHARE(self, stats)
    layers = 2
    return (self.coefficient * self.num_experts / layers
            * torch.dot(stats.counts, stats.prob_sums) / stats.rows ** 2)


def _neighbour_expert_outputs(experts: torch.nn.Module, tokens: torch.Tensor,
                              counts: list[int]) -> torch.Tensor:
    """Planted bug: each expert's rows go through the next expert (a wrong index)."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    outputs = []
    for expert, rows in enumerate(torch.split(tokens, counts)):
        other = (expert + 1) % gate_up.shape[0]
        gate, up = torch.nn.functional.linear(rows, gate_up[other]).chunk(2, dim=-1)
        outputs.append(torch.nn.functional.linear(experts.act_fn(gate) * up, down[other]))
    return torch.cat(outputs)


@contextmanager
def _planted(bug: str | None) -> Iterator[None]:
    saved = BalanceLoss.share, experts_module.expert_outputs
    if bug == "per-microbatch balancing loss":
        BalanceLoss.share = _per_microbatch_share  # type: ignore[method-assign]
    if bug == "wrong expert in the combine":
        experts_module.expert_outputs = _neighbour_expert_outputs
    try:
        yield
    finally:
        BalanceLoss.share, experts_module.expert_outputs = saved  # type: ignore[method-assign]


def _check_equivalence(rank: int, world_size: int) -> None:
    torch.set_num_threads(1)
    for family, pp, dp, tied in (("mixtral", 2, 1, False), ("qwen2_moe", 2, 1, False),
                                 ("qwen2_moe", 1, 2, False), ("qwen3_moe", 2, 1, True)):
        found = moe_step_differences(family, pp=pp, dp=dp, tied=tied)
        assert _within(found), (family, pp, dp, tied, found)
    # OLMoE (q/k norms, clamped qkv, every layer sparse) with its experts split over ep 2
    found = moe_step_differences("olmoe", pp=1, dp=2, ep=2)
    assert _within(found), found
    # padding: counted in neither the language-model loss nor the balancing loss
    found = moe_step_differences("mixtral", pp=2, dp=1, padded=True)
    assert _within(found), found
    # ties and an idle expert: top-1 over router rows (v, v, -v, 0)
    found = moe_step_differences("mixtral", pp=2, dp=1, top_k=1, ties=True)
    assert _within(found), found
    for logits in found["routes"]:
        assert torch.equal(logits[:, 0], logits[:, 1])  # experts 0 and 1 tie on every token
        assert (logits.argmax(-1) != 3).all()  # expert 3 never chosen
    for bug in ("per-microbatch balancing loss", "wrong expert in the combine"):
        with _planted(bug):
            found = moe_step_differences("qwen2_moe", pp=2, dp=1)
        assert not _within(found), (bug, found)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_moe_families_step_as_hf_and_planted_bugs_fail() -> None:
    """Mixtral, Qwen2-MoE (shared expert) and Qwen3-MoE (tied embeddings) at pp=2, Qwen2-MoE
    at dp=2 (the balancing loss spans both replicas' tokens), OLMoE at dp=2 × ep=2: loss
    with the balancing loss, every reduced gradient and every weight after one SGD step
    within 1e-5 of HF's step on the whole batch; a padded batch; routing with ties and an
    expert that gets no token; the two planted bugs fail."""
    run_ranks(_check_equivalence, 2, timeout=300)
