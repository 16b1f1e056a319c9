"""One training step of a tiny HF MoE model pipelined (pp × dp, optionally expert-parallel)
against HF's own step on the whole batch, as relative differences (test helper)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pipeline import PipelineEngine, PipelineModule
from pipeline.interop.hf_layers import causal_lm_targets, layers_from_hf
from pipeline.interop.hf_weights import gather_hf_state_dict, load_hf_weights
from pipeline.moe.balance_loss import train_batch_balanced
from pipeline.parallel.param_marks import expert_shard
from pipeline.parallel.zero import ShardedOptimizer
from tests.support.hf_models import token_batch
from tests.support.hf_moe_models import (
    plant_ties_and_an_idle_expert,
    tiny_moe_config,
    tiny_moe_model,
)

__all__ = ["moe_step_differences"]

LEARNING_RATE = 0.1


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-12))


def _hf_step(model: Any, ids: torch.Tensor, mask: torch.Tensor | None,
             labels: torch.Tensor, clip: float | None) -> tuple[float, float | None]:
    """HF's loss and gradients (clipped by torch's clip_grad_norm_ when `clip` is given:
    then also the norm before clipping)."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    norm = (None if clip is None
            else float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
    return float(out.loss.detach()), norm


def moe_step_differences(family: str, *, pp: int, dp: int, ep: int = 1, zero: int = 0,
                         top_k: int = 2, ties: bool = False, padded: bool = False,
                         tied: bool = False, clip: float | None = None, steps: int = 1,
                         schedule: str = "1f1b",
                         **engine: Any) -> dict[str, Any]:
    """On every rank: the pipelined step (SGD, 4 microbatches per replica, `schedule`) of the tiny
    `family` model against HF's on the concatenated batch of all replicas.

    Returns the relative differences ``loss``, ``grad`` and ``param`` (worst over
    parameters, over every rank), HF's router logits ``routes`` (for the case's own
    checks of ties and idle experts), ``handovers``, how often this rank's overlapped pairs
    ran an all-to-all under the other microbatch's compute, and ``two_batch_handovers``, how
    often a two-batch forward's half did so under the other half's. `padded`: right-padded rows with
    their attention mask, the token-summed loss (padding counts in neither loss, as in HF).
    `clip`: the engine's gradient_clipping against torch's clip_grad_norm_ on HF's model (then
    also ``norm``, the relative difference of the norms before clipping). `steps`: steps taken
    (the last one's loss and gradients compared; the weights after all of them)."""
    hf_model = tiny_moe_model(family, seed=3, top_k=top_k, tied=tied)
    if ties:
        plant_ties_and_an_idle_expert(hf_model)
    ids, mask = token_batch(8 * dp, 8, seed=2, padded=padded)
    labels = causal_lm_targets(ids, mask if padded else None)
    replica = dist.get_rank() % dp  # Topology: rank = pp_rank · dp + dp_rank
    hf = layers_from_hf(tiny_moe_config(family, top_k=top_k, tied=tied))
    chunks = 2 if schedule.startswith("dualpipev") else 1
    module = PipelineModule(hf.layers, num_stages=pp, chunks=chunks,
                            loss_fn=hf.summed_loss if padded else hf.loss_fn,
                            partition_method="uniform")
    load_hf_weights(module, hf, hf_model.state_dict())
    options: dict[str, Any] = {"data_parallel": dp, "expert_parallel": ep,
                               "gradient_clipping": clip, **engine}
    if zero:  # True: ZeRO-1
        options["zero_stage"] = int(zero)
    pipelined = PipelineEngine(module, schedule=schedule, num_microbatches=4, timeout=60,
                               optimizer=lambda p: torch.optim.SGD(p, lr=LEARNING_RATE),
                               **options)
    if bool(zero) != isinstance(pipelined.optimizer, ShardedOptimizer):
        raise AssertionError(f"zero={zero} but the engine built {pipelined.optimizer!r}")
    rows = slice(8 * replica, 8 * replica + 8)
    inputs = (ids[rows], mask[rows]) if padded else ids[rows]
    hf_optimizer = torch.optim.SGD(hf_model.parameters(), lr=LEARNING_RATE)
    for step in range(steps):
        if step:
            hf_optimizer.step()
        loss = train_batch_balanced(pipelined, hf.balance, inputs, labels[rows])
        expected, norm = _hf_step(hf_model, ids, mask if padded else None, labels, clip)
    with torch.no_grad():
        routes = hf_model(input_ids=ids, output_router_logits=True).router_logits
    reference = dict(hf_model.named_parameters())
    grads = pipelined.reduced_gradients()
    differences = []
    for key, param in module.named_layer_parameters():
        expected_grad = reference[hf.hf_name(*key)].grad
        shard = expert_shard(param)
        if shard is not None:  # this rank's experts of the layer
            expected_grad = expected_grad[shard[0]:shard[0] + param.shape[0]]
        # an expert shard no token reached has no gradient: HF's rows must then be zero
        differences.append(_relative(grads.get(key, torch.zeros_like(param)), expected_grad)
                           if expected_grad.abs().max() > 0 or key in grads
                           else 0.0)
    worst = torch.tensor(max(differences, default=0.0))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    hf_optimizer.step()
    state = gather_hf_state_dict(module, hf)
    missing = sorted(set(reference) - set(state))
    if missing:
        raise AssertionError(f"{family}: the export lacks {missing}")
    param = max(_relative(state[name], reference[name]) for name in reference)
    found = {"loss": abs(loss - expected) / abs(expected), "grad": float(worst),
             "param": param, "routes": routes,
             "handovers": pipelined._interpreter.pair_handovers,  # the engine's own counts
             "two_batch_handovers": pipelined._interpreter.two_batch_handovers}
    if norm is not None:
        measured = pipelined.training.step.grad_norm
        found["norm"] = abs(float(measured or 0.0) - norm) / norm
        found["clipped"] = norm > clip
    return found
