"""One training step of a tiny HF MoE model pipelined (pp × dp, optionally expert-parallel)
against HF's own step on the whole batch, as relative differences (test helper)."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeline import PipelineEngine, PipelineModule
from pipeline.interop.hf_layers import causal_lm_targets, layers_from_hf
from pipeline.interop.hf_moe import router_config
from pipeline.interop.hf_tensor_parallel import tensor_parallel_hf
from pipeline.interop.hf_weights import (
    checkpoint_tensors,
    gather_hf_state_dict,
    load_hf_weights,
    save_hf_checkpoint,
)
from pipeline.moe.balance_loss import train_batch_balanced
from pipeline.moe.layer import MoEFeedForward
from pipeline.parallel.param_marks import expert_shard
from pipeline.parallel.tensor.shard_layout import layout_of
from pipeline.parallel.zero import ShardedOptimizer
from tests.support.hf_models import token_batch
from tests.support.hf_moe_files import checkpoint_names, recording_reads
from tests.support.hf_moe_models import (
    plant_ties_and_an_idle_expert,
    tiny_moe_config,
    tiny_moe_model,
)

__all__ = ["HFLoss", "moe_step_differences"]

LEARNING_RATE = 0.1
SHARD = "20KB"
"""save_pretrained's shard size: the tiny models' experts spread over several files."""
INDEX = "model.safetensors.index.json"
def _expected_reads(family: str, module: PipelineModule, hf: Any, ep: int,
                    replica: int) -> list[str]:
    """The checkpoint names this rank needs: its stages' tensors, of each layer's E experts
    only ep rank ``replica % ep``'s E / ep consecutive ones."""
    ep_rank, local = replica % ep, router_config(hf.config).num_experts // ep
    mine = range(ep_rank * local, (ep_rank + 1) * local)
    keys = {hf.hf_name(*key) for key, _ in checkpoint_tensors(module)}
    return sorted(name for key in keys for name in checkpoint_names(family, key, mine))


def _exported(module: PipelineModule, hf: Any, reference: dict[str, torch.Tensor],
              saved_names: set[str]) -> dict[str, Any]:
    """`save_hf_checkpoint` of the trained module, loaded back by `from_pretrained`."""
    import transformers
    from safetensors import safe_open

    with tempfile.TemporaryDirectory() as directory:
        box = [directory]
        dist.broadcast_object_list(box, src=0)
        save_hf_checkpoint(module, hf, box[0])
        reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
            box[0], output_loading_info=True)
        with safe_open(str(Path(box[0], "model.safetensors")), "pt") as handle:
            names = set(handle.keys())
        dist.barrier()
    weights = dict(reloaded.named_parameters())
    return {"export_problems": {kind: found for kind, found in info.items() if found},
            "export": max(_relative(weights[name], reference[name]) for name in reference),
            "export_names": names == saved_names}

HFLoss = Callable[[Any, torch.Tensor, "torch.Tensor | None", torch.Tensor], torch.Tensor]
"""(HF model, input ids of the whole batch, attention mask or None, labels) -> the loss the
pipelined step should equal (default: HF's own ``model(..., labels=labels).loss``)."""


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-12))


def _hf_step(model: Any, ids: torch.Tensor, mask: torch.Tensor | None,
             labels: torch.Tensor, clip: float | None,
             reference: HFLoss | None = None) -> tuple[float, float | None]:
    """HF's loss and gradients (clipped by torch's clip_grad_norm_ when `clip` is given:
    then also the norm before clipping); `reference` replaces HF's loss."""
    model.zero_grad(set_to_none=True)
    loss = (model(input_ids=ids, attention_mask=mask, labels=labels).loss if reference is None
            else reference(model, ids, mask, labels))
    loss.backward()
    norm = (None if clip is None
            else float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
    return float(loss.detach()), norm


def _biases(module: PipelineModule, stages: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """HF layer index -> the aux-free expert bias of this rank's MoE layers."""
    found = {}
    for stage in stages:
        for key, layer in module.stage(stage).layers.items():
            for m in layer.modules():
                if isinstance(m, MoEFeedForward) and m.balancing.method == "aux-free":
                    found[int(key) - 1] = m.bias.detach().clone()
    return found


def moe_step_differences(family: str, *, pp: int, dp: int, ep: int = 1, zero: int = 0,
                         top_k: int = 2, ties: bool = False, padded: bool = False,
                         tied: bool = False, clip: float | None = None, steps: int = 1,
                         schedule: str = "1f1b", chunks: int | None = None,
                         export: bool = False,
                         strict_reads: bool = True, partition_method: str = "uniform",
                         balancing: Any = None, reference: HFLoss | None = None,
                         tp: int = 1, sequence_parallel: bool = False,
                         model_options: dict[str, Any] | None = None,
                         **engine: Any) -> dict[str, Any]:
    """On every rank: the pipelined step (SGD, 4 microbatches per replica, `schedule`) of the tiny
    `family` model against HF's on the concatenated batch of all replicas.

    Returns the relative differences ``loss``, ``grad`` and ``param`` (worst over
    parameters, over every rank), HF's router logits ``routes`` (for the case's own
    checks of ties and idle experts), ``handovers``, how often this rank's overlapped pairs
    ran an all-to-all under the other microbatch's compute, and ``two_batch_handovers``, how
    often a two-batch forward's half did so under the other half's, ``reads``, the tensors this
    rank read from the `save_pretrained` directory (small shards) it loaded, and
    ``expected_reads``, those its stages and experts need by definition (`strict_reads`: unequal
    ones raise, after the last collective; `partition_method`: the module's). `export`: also
    ``export_problems``, what `from_pretrained` found missing or unexpected in
    `save_hf_checkpoint`'s directory, ``export``, the relative difference of its weights from
    HF's, and ``export_names``, whether its names are `save_pretrained`'s. `padded`:
    right-padded rows with their attention mask, the token-summed loss (padding counts in
    neither loss, as in HF).
    `chunks`: stages per rank (default 2 for DualPipeV, else 1).
    `clip`: the engine's gradient_clipping against torch's clip_grad_norm_ on HF's model (then
    also ``norm``, the relative difference of the norms before clipping). `steps`: steps taken
    (the last one's loss and gradients compared; the weights after all of them).
    `balancing`: `layers_from_hf`'s; `reference`: the loss HF's model is stepped on instead
    of its own (`HFLoss`). Also returns ``biases`` (HF layer index -> this rank's aux-free
    expert bias after the steps), the ``engine`` and ``unit_bytes``, what ZeRO-3's layers
    held gathered after the last step (0 when each layer is freed). `tp` > 1:
    `tensor_parallel_hf`'s split (with `sequence_parallel`), each rank's gradient slices
    against HF's same slices. `model_options`: more `tiny_moe_config` options (DeepSeek's
    groups, q rank)."""
    shape = {"top_k": top_k, "tied": tied, **(model_options or {})}
    hf_model = tiny_moe_model(family, seed=3, **shape)
    if ties:
        plant_ties_and_an_idle_expert(hf_model)
    ids, mask = token_batch(8 * dp, 8, seed=2, padded=padded)
    labels = causal_lm_targets(ids, mask if padded else None)
    replica = dist.get_rank() // tp % dp  # Topology: rank = (pp_rank · dp + dp_rank) · tp + tp_rank
    hf = layers_from_hf(tiny_moe_config(family, **shape), balancing=balancing)
    if tp > 1:
        hf = tensor_parallel_hf(hf, sequence_parallel=sequence_parallel)
    if chunks is None:  # stages per rank
        chunks = 2 if schedule.startswith("dualpipev") else 1
    module = PipelineModule(hf.layers, num_stages=pp, chunks=chunks,
                            loss_fn=hf.summed_loss if padded else hf.loss_fn,
                            partition_method=partition_method)
    options: dict[str, Any] = {"data_parallel": dp, "expert_parallel": ep, "tensor_parallel": tp,
                               "gradient_clipping": clip, **engine}
    if zero:  # True: ZeRO-1
        options["zero_stage"] = int(zero)
    with tempfile.TemporaryDirectory() as directory:
        box = [directory]
        dist.broadcast_object_list(box, src=0)  # rank 0's directory (one file system)
        if dist.get_rank() == 0:
            hf_model.save_pretrained(box[0], max_shard_size=SHARD)
        dist.barrier()
        load_hf_weights(module, hf, box[0])  # read while the engine builds this rank's stages
        with recording_reads() as reads:
            pipelined = PipelineEngine(module, schedule=schedule, num_microbatches=4,
                                       timeout=60,
                                       optimizer=lambda p: torch.optim.SGD(p, lr=LEARNING_RATE),
                                       **options)
        saved_names = set(json.loads(Path(box[0], INDEX).read_text())["weight_map"])
        dist.barrier()
    expected_reads = _expected_reads(family, module, hf, ep, replica)
    if bool(zero) != isinstance(pipelined.optimizer, ShardedOptimizer):
        raise AssertionError(f"zero={zero} but the engine built {pipelined.optimizer!r}")
    rows = slice(8 * replica, 8 * replica + 8)
    inputs = (ids[rows], mask[rows]) if padded else ids[rows]
    hf_optimizer = torch.optim.SGD(hf_model.parameters(), lr=LEARNING_RATE)
    for step in range(steps):
        if step:
            hf_optimizer.step()
        loss = train_batch_balanced(pipelined, hf.balance, inputs, labels[rows])
        expected, norm = _hf_step(hf_model, ids, mask if padded else None, labels, clip,
                                  reference)
    unit_bytes = getattr(pipelined.optimizer, "unit_storage_bytes", lambda: 0)()
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
        layout = layout_of(param)
        if layout is not None:  # this tp rank's slice
            expected_grad = layout.shard(expected_grad)
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
             "param": param, "routes": routes, "reads": sorted(reads),
             "expected_reads": expected_reads, "unit_bytes": unit_bytes,
             "handovers": pipelined._interpreter.pair_handovers,  # the engine's own counts
             "two_batch_handovers": pipelined._interpreter.two_batch_handovers,
             "biases": _biases(module, pipelined.stage_ids), "engine": pipelined}
    if export:
        found.update(_exported(module, hf, reference, saved_names))
    if norm is not None:
        measured = pipelined.training.step.grad_norm
        found["norm"] = abs(float(measured or 0.0) - norm) / norm
        found["clipped"] = norm > clip
    if strict_reads and found["reads"] != expected_reads:  # after the last collective
        raise AssertionError(f"{family}: rank {dist.get_rank()} read {found['reads']}, its "
                             f"stages and experts need {expected_reads}")
    return found
