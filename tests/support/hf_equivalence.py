"""One training step of a tiny HF family pipelined against HF itself, as max differences
(test helper; also printed by benchmarks/hf_families_equivalence.py)."""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist

from pipeline import PipelineEngine, PipelineModule
from pipeline.interop.hf_layers import causal_lm_targets, layers_from_hf
from pipeline.interop.hf_weights import gather_hf_state_dict, load_hf_weights, save_hf_checkpoint
from tests.support.hf_models import tiny_config, tiny_model, token_batch

__all__ = ["step_differences"]


def _max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).abs().max())


def step_differences(family: str, schedule: str = "1f1b", *, tied: bool = True,
                     learning_rate: float = 0.1) -> dict[str, float]:
    """On every rank of the default group: the pipelined run of `family` (weights read from
    a saved HF checkpoint, each rank only its own stages'; one SGD step over 4 microbatches
    of `schedule`) against HF's model(labels=) + backward + the same step.

    Returns max absolute differences: ``loss``, ``grad`` (over every parameter),
    ``param`` (after the step, exported back to HF names) and ``logits`` (of a HF model
    reloaded with ``from_pretrained`` from the pipeline's exported checkpoint)."""
    import transformers

    hf_model = tiny_model(family, tied=tied, seed=3)
    ids, _ = token_batch(8, 8, seed=2)
    labels = causal_lm_targets(ids)
    hf = layers_from_hf(tiny_config(family, tied=tied))
    module = PipelineModule(hf.layers, num_stages=dist.get_world_size(), loss_fn=hf.loss_fn,
                            partition_method="uniform")
    with tempfile.TemporaryDirectory() as directory:
        box = [directory]
        dist.broadcast_object_list(box, src=0)
        if dist.get_rank() == 0:
            hf_model.save_pretrained(box[0] + "/source")
        dist.barrier()
        load_hf_weights(module, hf, box[0] + "/source")
        engine = PipelineEngine(module, schedule=schedule, num_microbatches=4, timeout=60,
                                optimizer=lambda p: torch.optim.SGD(p, lr=learning_rate))
        dist.barrier()
    held = {hf.hf_name(*key) for key, _ in module.named_layer_parameters()}
    if not held < set(dict(hf_model.named_parameters())):
        raise AssertionError(f"{family}: a rank read tensors of stages it does not hold")
    loss = engine.train_batch(ids, labels)

    expected = hf_model(input_ids=ids, labels=labels).loss
    expected.backward()
    reference = dict(hf_model.named_parameters(remove_duplicate=False))
    grads = [_max_difference(param.grad, reference[hf.hf_name(*key)].grad)
             for key, param in module.named_layer_parameters() if param.grad is not None]
    if len(grads) != len(held):
        raise AssertionError(f"{family}: {len(held) - len(grads)} parameters got no grad")
    grad = torch.tensor(max(grads, default=0.0))
    dist.all_reduce(grad, op=dist.ReduceOp.MAX)
    torch.optim.SGD(hf_model.parameters(), lr=learning_rate).step()

    state = gather_hf_state_dict(module, hf)
    target = hf_model.state_dict()
    missing = sorted(set(dict(hf_model.named_parameters())) - set(state))
    if missing:
        raise AssertionError(f"{family}: the export lacks {missing}")
    param = max(_max_difference(state[name], target[name]) for name in state)
    with tempfile.TemporaryDirectory() as directory:
        box = [directory]
        dist.broadcast_object_list(box, src=0)
        save_hf_checkpoint(module, hf, box[0])
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(box[0])
        logits = _max_difference(reloaded(input_ids=ids).logits, hf_model(input_ids=ids).logits)
        dist.barrier()
    return {"loss": abs(loss - float(expected)), "grad": float(grad), "param": param,
            "logits": logits}
