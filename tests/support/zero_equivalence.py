"""ZeRO-2 / 3 on a tiny HF Llama (read from a save_pretrained directory) against HF itself,
as max differences over two SGD steps, and the bytes each rank holds (test helper)."""

from __future__ import annotations

import tempfile
from typing import Any

import torch
import torch.distributed as dist

from pipeline import PipelineEngine, PipelineModule
from pipeline.interop.hf_layers import causal_lm_targets, layers_from_hf
from pipeline.interop.hf_weights import load_hf_weights
from pipeline.parallel.tied_sync import TIED_REGION
from pipeline.parallel.zero import ShardedOptimizer
from pipeline.parallel.zero3 import FullyShardedOptimizer
from tests.support.hf_models import tiny_config, token_batch

__all__ = ["zero_differences"]

BATCH = 16
"""Global batch: dp 2 × 4 microbatches × 2 rows."""
LAYERS = 6


def _difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).abs().max())


def _config() -> Any:
    """`tiny_config("llama")` (tied embedding / head) with 6 decoder layers, so a stage holds
    several layers to gather one at a time."""
    config = tiny_config("llama", tied=True)
    config.num_hidden_layers = LAYERS
    return config


def _saved_llama(directory: str) -> torch.nn.Module:
    """The seeded tiny Llama of `_config`, saved by rank 0 into `directory`."""
    import transformers

    torch.manual_seed(3)
    hf_model = transformers.AutoModelForCausalLM.from_config(_config())
    if dist.get_rank() == 0:
        hf_model.save_pretrained(directory)
    dist.barrier()
    return hf_model


def _count_gathers(sharded: FullyShardedOptimizer, result: dict[str, Any]) -> None:
    """Count the unit gathers that collect, and the most units gathered at once."""
    launch = sharded.prefetch  # every gather that collects launches here (prefetched or not)

    def counted(key: int) -> None:
        if key not in sharded.gathered_units():
            result["gathers"] += 1
        launch(key)
        result["peak_gathered"] = max(result["peak_gathered"], len(sharded.gathered_units()))
    sharded.prefetch = counted  # type: ignore[method-assign]


def zero_differences(zero_stage: int, schedule: str, chunks: int, *,
                     reshard_after_forward: bool = True,
                     prefetch_next_unit: bool = True) -> dict[str, Any]:
    """Two steps of the pipelined, data-parallel ZeRO run (each replica its half of the
    batch) and of HF on the whole batch: max |difference| of loss, reduced gradients and
    updated weights; and after the last step the gradient bytes this rank holds next to its
    shards' and the whole regions' sizes, and the gathered parameter bytes (ZeRO-3)."""
    hf = layers_from_hf(_config())
    module = PipelineModule(hf.layers, num_stages=2, chunks=chunks, loss_fn=hf.loss_fn,
                            partition_method="uniform")
    with tempfile.TemporaryDirectory() as directory:
        box = [directory]
        dist.broadcast_object_list(box, src=0)
        hf_model = _saved_llama(box[0])
        load_hf_weights(module, hf, box[0])  # read when the engine builds the stages
        engine = PipelineEngine(module, schedule=schedule, num_microbatches=4, timeout=60,
                                data_parallel=2, zero_stage=zero_stage, bucket_mb=2**-12,
                                reshard_after_forward=reshard_after_forward,
                                prefetch_next_unit=prefetch_next_unit,
                                optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
        dist.barrier()
    sharded = engine.optimizer
    if not isinstance(sharded, ShardedOptimizer):
        raise AssertionError(f"zero_stage={zero_stage} built {type(sharded).__name__}")
    result: dict[str, Any] = {"loss": 0.0, "grad": 0.0, "param": 0.0, "gathers": 0,
                              "peak_gathered": 0}
    if isinstance(sharded, FullyShardedOptimizer):
        _count_gathers(sharded, result)
        result["units"] = len(sharded.layouts()) - (TIED_REGION in sharded.layouts())
    reference = dict(hf_model.named_parameters(remove_duplicate=False))
    hf_optimizer = torch.optim.SGD(hf_model.parameters(), lr=0.1)
    ids, _ = token_batch(BATCH, 8, seed=2)
    labels = causal_lm_targets(ids)
    rows = slice(engine.position.dp_rank * BATCH // 2, (engine.position.dp_rank + 1) * BATCH // 2)
    for step in range(2):
        loss = engine.train_batch(ids[rows], labels[rows])
        if step == 0:  # the first step alone (later ones start from what the reads gathered)
            result["step_gathers"], result["step_peak"] = (result["gathers"],
                                                           result["peak_gathered"])
        hf_optimizer.zero_grad()
        expected = hf_model(input_ids=ids, labels=labels).loss
        expected.backward()
        result["loss"] = max(result["loss"], abs(loss - float(expected.detach())))
        if isinstance(sharded, FullyShardedOptimizer):  # before anything gathers them again
            result["gathered_bytes"] = sum(
                sharded.layouts()[key].size * 4 for key in sharded.gathered_units())
            result["unit_storage_bytes"] = sharded.unit_storage_bytes()
        result["grad_bytes"] = sharded.gradient_buffer_bytes()
        result["model_grads"] = sum(p.grad is not None for p in module.parameters())
        grads = engine.reduced_gradients()
        hf_optimizer.step()
        engine.finish_param_gather()
        for key, param in module.named_layer_parameters():
            name = hf.hf_name(*key)
            result["grad"] = max(result["grad"], _difference(grads[key], reference[name].grad))
            result["param"] = max(result["param"], _difference(param, reference[name]))
    layouts = sharded.layouts()
    result["shard_bytes"] = sum(layout.shard_numel * 4 for layout in layouts.values())
    result["whole_bytes"] = sum(layout.size * 4 for layout in layouts.values())
    result["dp"] = engine.topology.dp
    return result
