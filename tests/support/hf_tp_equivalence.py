"""One training step of a tiny HF family at pp × dp × tp against HF itself (test helper)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pipeline import PipelineEngine, PipelineModule
from pipeline.interop.hf_layers import causal_lm_targets, layers_from_hf
from pipeline.interop.hf_tensor_parallel import tensor_parallel_hf
from pipeline.interop.hf_weights import (
    gather_hf_state_dict,
    load_hf_weights,
    save_hf_checkpoint,
)
from pipeline.parallel.tensor.shard_layout import layout_of
from tests.support.hf_models import tiny_config, tiny_model, token_batch

__all__ = ["TPCase", "tp_checkpoint_resume_errors", "tp_step_errors"]

LEARNING_RATE = 0.1


@dataclass(frozen=True)
class TPCase:
    """A tiny HF family at pp = `stages` (2) with tp, dp, ZeRO-1, recomputation and a schedule."""

    family: str
    tp: int
    dp: int = 1
    sequence_parallel: bool = False
    zero: int = 0
    """ZeRO stage (True: 1)."""
    recompute: str = "none"
    schedule: str = "1f1b"
    chunks: int = 1
    """Stages per pipeline rank (2: interleaved, zb-v)."""
    tied: bool = True
    from_model: bool = False
    """Split the HF model's own modules (``layers_from_hf(model)``; each rank slices a copy,
    leaving the model, here also the reference, whole) instead of building from the config
    and loading the checkpoint."""
    overlap: bool = False
    """``tensor_parallel_hf(..., overlap=True)``: the tp collectives beside the GEMMs."""
    export: bool = False
    """Also write the trained weights with `save_hf_checkpoint` and reload them with
    ``from_pretrained`` (strict): ``export`` is the relative error of its logits."""
    engine: dict[str, Any] = field(default_factory=dict)
    stages: int = 2
    microbatches: int = 2

    @property
    def world(self) -> int:
        return self.stages * self.tp * self.dp

    def label(self) -> str:
        parts = [self.family, f"tp{self.tp}", f"dp{self.dp}" if self.dp > 1 else "",
                 "sp" if self.sequence_parallel else "",
                 f"zero{int(self.zero)}" if self.zero else "",
                 self.recompute if self.recompute != "none" else "",
                 self.schedule if self.schedule != "1f1b" else "",
                 f"v{self.chunks}" if self.chunks > 1 else "",
                 "half" if self.engine.get("half_parameters") else "",
                 "" if self.tied else "untied", "from-model" if self.from_model else "",
                 "overlap" if self.overlap else ""]
        return "-".join(p for p in parts if p)


def _relative(errors: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """||got - want|| / ||want|| over every pair, summed over this rank's tensors and then
    over the world (every rank returns the same figure)."""
    sums = torch.zeros(2, dtype=torch.float64)
    for got, want in errors:
        sums[0] += (got.double() - want.double()).pow(2).sum()
        sums[1] += want.double().pow(2).sum()
    dist.all_reduce(sums)
    return float(sums[0].sqrt() / sums[1].sqrt())


def _export_error(module: PipelineModule, hf: Any, hf_model: Any, ids: torch.Tensor) -> float:
    import transformers

    with tempfile.TemporaryDirectory() as directory:
        box = [directory]
        dist.broadcast_object_list(box, src=0)
        save_hf_checkpoint(module, hf, box[0])
        reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
            box[0], output_loading_info=True)
        problems = {k: v for k, v in info.items() if v}
        if problems:
            raise AssertionError(f"from_pretrained did not load the export strictly: {problems}")
        with torch.no_grad():
            got, want = reloaded(input_ids=ids).logits, hf_model(input_ids=ids).logits
        dist.barrier()
    return float((got - want).norm() / want.norm())


def tp_step_errors(case: TPCase) -> dict[str, float]:
    """On every rank of the default group: one SGD step of `case` (weights read from a
    saved HF checkpoint, each tp rank only its slices) against HF's model(labels=) +
    backward + the same step; relative errors of the loss, of every gradient (each rank's
    slice against the same slice of HF's gradient) and of the updated weights (the
    pipeline's, merged back into whole HF tensors)."""
    torch.set_num_threads(1)
    hf_model = tiny_model(case.family, tied=case.tied, seed=3)
    ids, _ = token_batch(8, 8, seed=2)
    labels = causal_lm_targets(ids)
    source = hf_model if case.from_model else tiny_config(case.family, tied=case.tied)
    hf = tensor_parallel_hf(layers_from_hf(source), sequence_parallel=case.sequence_parallel,
                            overlap=case.overlap)
    module = PipelineModule(hf.layers, num_stages=case.stages, chunks=case.chunks,
                            loss_fn=hf.loss_fn,
                            partition_method="uniform", recompute=case.recompute)
    with tempfile.TemporaryDirectory() as directory:
        box = [directory]
        dist.broadcast_object_list(box, src=0)
        if dist.get_rank() == 0:
            hf_model.save_pretrained(box[0])
        dist.barrier()
        if not case.from_model:
            load_hf_weights(module, hf, box[0])
        engine = PipelineEngine(module, schedule=case.schedule,
                                num_microbatches=case.microbatches,
                                tensor_parallel=case.tp, data_parallel=case.dp,
                                zero_stage=int(case.zero), timeout=60,
                                optimizer=lambda p: torch.optim.SGD(p, lr=LEARNING_RATE),
                                **case.engine)
        dist.barrier()
    rows = ids.shape[0] // case.dp
    mine = slice(engine.position.dp_rank * rows, (engine.position.dp_rank + 1) * rows)
    loss = engine.train_batch(ids[mine], labels[mine])
    grads = engine.reduced_gradients()

    expected = hf_model(input_ids=ids, labels=labels).loss
    expected.backward()
    reference = dict(hf_model.named_parameters(remove_duplicate=False))
    pairs = []
    for key, param in module.named_layer_parameters():
        want = reference[hf.hf_name(*key)].grad
        layout = layout_of(param)
        pairs.append((grads[key], want if layout is None else layout.shard(want)))
    grad = _relative(pairs)
    torch.optim.SGD(hf_model.parameters(), lr=LEARNING_RATE).step()
    engine.finish_param_gather()
    state = gather_hf_state_dict(module, hf)
    target = hf_model.state_dict()
    missing = sorted(set(dict(hf_model.named_parameters())) - set(state))
    if missing:
        raise AssertionError(f"{case.label()}: the export lacks {missing}")
    param_pairs = [(state[name], target[name]) for name in state]
    param_error = _relative(param_pairs) if dist.get_rank() == 0 else _relative([])
    box_error = [param_error]
    dist.broadcast_object_list(box_error, src=0)
    export = _export_error(module, hf, hf_model, ids) if case.export else 0.0
    return {"export": export, "loss": abs(loss - expected.item()) / abs(expected.item()),
            "grad": grad,
            "param": float(box_error[0]),
            "sharded": float(any(layout_of(p) is not None for p in module.parameters()))}


def tp_checkpoint_resume_errors(family: str = "llama") -> tuple[float, float]:
    """pp 2 × tp 2 with sequence parallelism and ZeRO-1 under Adam: two steps, a checkpoint
    saved after the first and loaded into a new engine, against HF's own two Adam steps.
    Returns the relative errors of (the resumed second loss vs the uninterrupted one, the
    uninterrupted second loss vs HF's)."""
    torch.set_num_threads(1)
    hf = tensor_parallel_hf(layers_from_hf(tiny_config(family)), sequence_parallel=True)
    ids, _ = token_batch(8, 8, seed=2)
    labels = causal_lm_targets(ids)

    def adam(params: Any) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=1e-2, eps=1e-4)

    def engine() -> PipelineEngine:
        module = PipelineModule(hf.layers, num_stages=2, loss_fn=hf.loss_fn,
                                partition_method="uniform")
        load_hf_weights(module, hf, tiny_model(family, seed=3).state_dict())
        return PipelineEngine(module, num_microbatches=2, tensor_parallel=2, zero_stage=1,
                              timeout=60, optimizer=adam)

    with tempfile.TemporaryDirectory() as directory:
        box = [directory]
        dist.broadcast_object_list(box, src=0)
        first = engine()
        first.train_batch(ids, labels)
        first.save_checkpoint(box[0])
        uninterrupted = first.train_batch(ids, labels)
        second = engine()
        second.load_checkpoint(box[0])
        resumed = second.train_batch(ids, labels)
        dist.barrier()
    model = tiny_model(family, seed=3)
    optimizer = adam(model.parameters())
    for _ in range(2):
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
    return (abs(resumed - uninterrupted) / uninterrupted,
            abs(uninterrupted - loss.item()) / loss.item())
