"""Census-free MoE balancing on pp=2 × dp=2 × ep=2 ranks: a step with Megatron-Core's
per-microbatch loss equals HF's model stepped on the oracle's loss, and DeepSeek-V3's
aux-free bias after a step is the oracle's on every rank and comes back from the engine
checkpoint; planted bugs (the loss averaged over the microbatches twice, the loads not
summed over the replicas) fail."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytest.importorskip("transformers")

from pipeline import PipelineEngine, PipelineModule
from pipeline.interop.hf_layers import layers_from_hf
from pipeline.moe import router_losses
from pipeline.moe.expert_bias import update_expert_biases
from pipeline.runtime import engine as engine_module
from tests.interop.test_moe_balancing import switch_oracle
from tests.support.hf_moe_equivalence import moe_step_differences
from tests.support.hf_moe_models import tiny_moe_config
from tests.support.rank_harness import run_ranks

COEF, TOP_K, ROWS_PER_MICROBATCH, RATE = 0.5, 2, 2, 1e-3
LAYOUT = {"pp": 2, "dp": 2, "ep": 2}


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                           labels[:, 1:].reshape(-1), ignore_index=-100)


def microbatch_reference(model: Any, ids: torch.Tensor, mask: torch.Tensor | None,
                         labels: torch.Tensor) -> torch.Tensor:
    """The step's loss from the definition: the whole batch is dp replicas × m microbatches
    of 2 rows, in order; each microbatch's cross entropy plus, per MoE layer, the Switch loss
    of its own tokens; the mean over microbatches and replicas (Megatron-Core's
    1 / (m · dp) scaling)."""
    losses = []
    for rows in torch.split(torch.arange(ids.shape[0]), ROWS_PER_MICROBATCH):
        out = model(input_ids=ids[rows], output_router_logits=True)
        aux = torch.stack([switch_oracle(logits, TOP_K, COEF) for logits in out.router_logits])
        losses.append(_cross_entropy(out.logits, labels[rows]) + aux.sum())
    return torch.stack(losses).mean()


def plain_reference(model: Any, ids: torch.Tensor, mask: torch.Tensor | None,
                    labels: torch.Tensor) -> torch.Tensor:
    """HF's cross entropy alone (aux-free adds no loss; its first step routes as HF)."""
    return _cross_entropy(model(input_ids=ids).logits, labels)


def bias_oracle(routes: tuple[torch.Tensor, ...]) -> dict[int, torch.Tensor]:
    """Per layer: u · sign(mean load - load), the load every token of the whole step (all
    microbatches, all replicas) gave each expert by its top-k choice."""
    found = {}
    for layer, logits in enumerate(routes):
        chosen = torch.softmax(logits, -1).topk(TOP_K, -1).indices.reshape(-1)
        loads = torch.bincount(chosen, minlength=logits.shape[-1]).float()
        found[layer] = RATE * torch.sign(loads.mean() - loads)
    return found


def _within(found: dict[str, Any]) -> bool:
    return all(found[k] <= 1e-5 for k in ("loss", "grad", "param"))


def _biases_match(found: dict[str, Any]) -> bool:
    expected = bias_oracle(found["routes"])
    return all(torch.allclose(bias, expected[layer], atol=1e-9)
               for layer, bias in found["biases"].items())


def _restored_biases(directory: str) -> dict[int, torch.Tensor]:
    """A fresh aux-free engine's biases after loading the checkpoint in `directory`."""
    from tests.support.hf_moe_equivalence import _biases

    hf = layers_from_hf(tiny_moe_config("mixtral"), balancing="aux-free")
    module = PipelineModule(hf.layers, num_stages=2, loss_fn=hf.loss_fn,
                            partition_method="uniform")
    engine = PipelineEngine(module, schedule="1f1b", num_microbatches=4, timeout=60,
                            data_parallel=2, expert_parallel=2,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert all(float(b.abs().sum()) == 0 for b in _biases(module, engine.stage_ids).values())
    engine.load_checkpoint(directory)
    return _biases(module, engine.stage_ids)


def _updated_without_reduction(layers: Any, group: Any, tp_group: Any = None) -> None:
    """Planted bug: each replica moves its bias by its own loads only."""
    update_expert_biases(layers, None)


def _check(rank: int, world_size: int, directory: str) -> None:
    torch.set_num_threads(1)
    # 1. Megatron-Core's per-microbatch loss: loss, gradients, weights as the oracle's step
    found = moe_step_differences("mixtral", **LAYOUT, balancing="microbatch",
                                 reference=microbatch_reference)
    assert _within(found), found
    switch = router_losses.switch_loss
    router_losses.switch_loss = lambda *a: switch(*a) / 4  # type: ignore[assignment]
    try:  # planted: averaged over the m = 4 microbatches twice
        found = moe_step_differences("mixtral", **LAYOUT, balancing="microbatch",
                                     reference=microbatch_reference)
    finally:
        router_losses.switch_loss = switch
    assert not _within(found), found
    # 2. aux-free: the step as HF's without a loss, the bias the oracle's on every rank, and
    #    the same bias back from the engine checkpoint
    found = moe_step_differences("mixtral", **LAYOUT, balancing="aux-free",
                                 reference=plain_reference)
    assert _within(found), found
    assert _biases_match(found), (found["biases"], bias_oracle(found["routes"]))
    held = torch.tensor(float(len(found["biases"])))
    dist.all_reduce(held)  # (uniform cut: stage 0 holds both MoE layers, on each replica)
    assert int(held) == 2 * LAYOUT["dp"], int(held)
    assert all(float(b.abs().sum()) > 0 for b in found["biases"].values())
    found["engine"].save_checkpoint(directory)
    restored = _restored_biases(directory)
    assert restored.keys() == found["biases"].keys()
    assert all(torch.equal(restored[k], found["biases"][k]) for k in restored)
    saved = engine_module.update_expert_biases
    engine_module.update_expert_biases = _updated_without_reduction
    try:
        found = moe_step_differences("mixtral", **LAYOUT, balancing="aux-free",
                                     reference=plain_reference)
    finally:
        engine_module.update_expert_biases = saved
    planted = torch.tensor(float(not _biases_match(found)))
    dist.all_reduce(planted)  # some rank's bias must differ from the oracle
    assert float(planted) > 0, found["biases"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_census_free_balancing_on_pp2_dp2_ep2(tmp_path: Path) -> None:
    """Mixtral on pp=2 × dp=2 × ep=2, 4 microbatches per replica: the per-microbatch loss's
    step (loss, every reduced gradient, weights after SGD) within 1e-5 of HF's model stepped
    on the oracle's loss; aux-free: the step within 1e-5 of HF's without a loss, each rank's
    bias equal to the oracle's (loads summed over microbatches and replicas) and restored by
    a fresh engine from the checkpoint; the two planted bugs fail."""
    run_ranks(_check, 4, str(tmp_path / "checkpoint"), timeout=400)
