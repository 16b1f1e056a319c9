"""One training step of a tiny HF MoE model at pp × dp × cp × ep against HF's step on the whole
batch, as relative differences (test helper)."""

from __future__ import annotations

import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipeline import PipelineEngine, PipelineModule
from pipeline.interop.hf_context_parallel import context_parallel_hf
from pipeline.interop.hf_layers import causal_lm_targets, layers_from_hf
from pipeline.interop.hf_weights import gather_hf_state_dict, load_hf_weights
from pipeline.moe.balance_loss import train_batch_balanced
from pipeline.parallel.param_marks import expert_shard
from tests.interop.test_moe_balancing import switch_oracle
from tests.support.hf_models import token_batch
from tests.support.hf_moe_models import tiny_moe_config, tiny_moe_model

__all__ = ["ROWS_PER_MICROBATCH", "moe_cp_step"]

LEARNING_RATE = 0.1
ROWS_PER_MICROBATCH = 2
MICROBATCHES = 2
COEF, TOP_K = 0.5, 2


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-12))


def _microbatch_reference(model: Any, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Megatron-Core's per-microbatch loss from its definition: each microbatch of 2 whole
    sequences, its cross entropy plus, per MoE layer, the Switch loss of all its tokens; the
    mean over microbatches (and replicas, in row order)."""
    losses = []
    for rows in torch.split(torch.arange(ids.shape[0]), ROWS_PER_MICROBATCH):
        out = model(input_ids=ids[rows], output_router_logits=True)
        aux = torch.stack([switch_oracle(logits, TOP_K, COEF) for logits in out.router_logits])
        cross = F.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]),
                                labels[rows][:, 1:].reshape(-1), ignore_index=-100)
        losses.append(cross + aux.sum())
    return torch.stack(losses).mean()


def _engine(module: PipelineModule, pp: int, dp: int, cp: int, ep: int,
            clip: float | None) -> PipelineEngine:
    return PipelineEngine(module, schedule="1f1b", num_microbatches=MICROBATCHES,
                          data_parallel=dp, context_parallel=cp, expert_parallel=ep,
                          timeout=60, gradient_clipping=clip,
                          optimizer=lambda p: torch.optim.SGD(p, lr=LEARNING_RATE))


def _reloaded(family: str, balancing: str | None, pp: int, dp: int, cp: int, ep: int,
              engine: PipelineEngine) -> float:
    """Save `engine`'s checkpoint, load it into a fresh engine of the same layout (random
    weights): the largest relative difference of the exported weights."""
    hf = context_parallel_hf(layers_from_hf(tiny_moe_config(family), balancing=balancing))
    module = PipelineModule(hf.layers, num_stages=pp, loss_fn=hf.loss_fn,
                            partition_method="uniform")
    fresh = _engine(module, pp, dp, cp, ep, None)
    with tempfile.TemporaryDirectory() as directory:
        box = [directory]
        dist.broadcast_object_list(box, src=0)
        engine.save_checkpoint(box[0])
        fresh.load_checkpoint(box[0])
        dist.barrier()
    trained = gather_hf_state_dict(engine.module, hf)
    loaded = gather_hf_state_dict(module, hf)
    return max(_relative(loaded[name], trained[name]) for name in trained)


def moe_cp_step(family: str, *, pp: int, dp: int, cp: int, ep: int,
                balancing: str | None = None, padded: bool = False, ring: bool = False,
                length: int = 8, clip: float | None = None,
                checkpoint: bool = False) -> dict[str, float]:
    """On every rank: one SGD step of `context_parallel_hf(layers_from_hf(...))` read from a
    `save_pretrained` directory, every cp rank of a replica passing the replica's rows, with
    HF's whole-batch balancing loss (census; ``output_router_logits=True``) or, for
    ``balancing="microbatch"``, Megatron-Core's per-microbatch loss; against HF's model on
    the whole batch (or the per-microbatch definition). Relative differences ``loss``,
    ``grad`` (every reduced gradient, each expert shard against HF's same experts) and
    ``param`` (the exported state after the step), worst over the ranks. `clip`: the
    engine's gradient clipping against torch's clip_grad_norm_ on HF's model (also
    ``norm``, the norms' relative difference). `checkpoint`: also ``reload``, the weights
    of a fresh engine loading this one's checkpoint against this one's."""
    torch.set_num_threads(1)
    hf_model = tiny_moe_model(family, seed=3)
    rows_per_replica = ROWS_PER_MICROBATCH * MICROBATCHES
    ids, mask = token_batch(rows_per_replica * dp, length, seed=2, padded=padded)
    labels = causal_lm_targets(ids, mask if padded else None)
    hf = context_parallel_hf(layers_from_hf(tiny_moe_config(family), balancing=balancing),
                             attention="ring" if ring else "all-gather")
    module = PipelineModule(hf.layers, num_stages=pp, loss_fn=hf.loss_fn,
                            partition_method="uniform")
    with tempfile.TemporaryDirectory() as directory:
        box = [directory]
        dist.broadcast_object_list(box, src=0)
        if dist.get_rank() == 0:
            hf_model.save_pretrained(box[0])
        dist.barrier()
        load_hf_weights(module, hf, box[0])
        engine = _engine(module, pp, dp, cp, ep, clip)
        dist.barrier()
    replica = engine.position.dp_rank
    rows = slice(rows_per_replica * replica, rows_per_replica * (replica + 1))
    inputs = (ids[rows], mask[rows]) if padded else ids[rows]
    loss = train_batch_balanced(engine, hf.balance, inputs, labels[rows])
    if balancing == "microbatch":
        expected = _microbatch_reference(hf_model, ids, labels)
    else:
        expected = hf_model(input_ids=ids, attention_mask=mask if padded else None,
                            labels=labels).loss
    expected.backward()
    found: dict[str, float] = {}
    if clip is not None:
        norm = float(torch.nn.utils.clip_grad_norm_(hf_model.parameters(), clip))
        found["norm"] = abs(float(engine.training.step.grad_norm or 0.0) - norm) / norm
        found["clipped"] = float(norm > clip)
    reference = dict(hf_model.named_parameters())
    grads = engine.reduced_gradients()
    differences = []
    for key, param in module.named_layer_parameters():
        want = reference[hf.hf_name(*key)].grad
        shard = expert_shard(param)
        if shard is not None:  # this rank's experts of the layer
            want = want[shard[0]:shard[0] + param.shape[0]]
        differences.append(_relative(grads.get(key, torch.zeros_like(param)), want))
    grad = torch.tensor(max(differences, default=0.0))
    dist.all_reduce(grad, op=dist.ReduceOp.MAX)
    torch.optim.SGD(hf_model.parameters(), lr=LEARNING_RATE).step()
    state = gather_hf_state_dict(module, hf)
    param = max(_relative(state[name], reference[name]) for name in reference)
    want = float(expected.detach())
    found.update({"loss": abs(loss - want) / abs(want), "grad": float(grad), "param": param})
    if checkpoint:
        found["reload"] = _reloaded(family, balancing, pp, dp, cp, ep, engine)
    return found
