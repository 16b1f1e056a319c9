"""Activation bytes one cp rank holds, counted, against the planner's prediction for the same
shape: a tiny HF Llama (`layers_from_hf`, then `context_parallel_hf` at cp > 1) on one
pipeline stage, one microbatch, at cp 1, 2 and 4. Shared by
tests/interop/test_cp_activation_counts.py and benchmarks/bench_cp_activations.py; run on 4
gloo ranks (cp 1 and 2 as data-parallel replicas of the same batch)."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from pipeline import PipelineEngine, PipelineModule
from pipeline.interop.hf_context_parallel import context_parallel_hf
from pipeline.interop.hf_layers import causal_lm_targets, layers_from_hf
from pipeline.planner import PRESETS, PlanConfig, PlanContext, load_model
from pipeline.runtime.saved_memory import SavedTensorMeter
from tests.support.hf_models import tiny_config, token_batch

__all__ = ["SIZES", "CPCount", "count_cp_activations", "predicted_cp_activations"]

SIZES = (1, 2, 4)
"""The cp sizes counted; 4 ranks run them (dp = 4 / cp replicas of the same batch)."""
# s sequence, b microbatch: long enough that S / 4 is still a few chunks of rows
S, B = 128, 2


@dataclass(frozen=True)
class CPCount:
    """One cp size: bytes of one microbatch on this rank."""

    cp: int
    counted: int
    """The peak of saved bytes during a one-microbatch step (`SavedTensorMeter`), parameters
    and the batch left out."""
    predicted: float
    """The planner's activations held at that step's peak (`PlanContext.held_trace` of its
    stage table at this cp; `context_parallel.context_table`)."""


def _config() -> object:
    config = tiny_config("llama", tied=False)
    config.max_position_embeddings = S
    return config


def predicted_cp_activations(cp: int) -> float:
    """The planner's activation bytes held at the peak of a one-microbatch step of `B`
    samples of `S` tokens at pp 1, tp 1, this cp, fp32, priced from the model's config.json
    (its blocks as HF's eager modules, `hf_activations`)."""
    with tempfile.TemporaryDirectory() as directory:
        with open(os.path.join(directory, "config.json"), "w") as file:
            json.dump(_config().to_dict(), file)  # type: ignore[attr-defined]
        model = load_model(directory, seq=S, precision="fp32")
    context = PlanContext(model, replace(PRESETS["a100-80g"], nodes=1), B * (4 // cp),
                          "fp32")
    config = PlanConfig(pp=1, tp=1, dp=4 // cp, cp=cp, schedule="1f1b", chunks=1,
                        microbatch_size=B, num_microbatches=1, zero_stage=0, recompute="none")
    trace = context.held_trace(config)
    assert trace is not None
    return float(trace.peak_bytes(context.table(config).held * B)[0])


def _counted(cp: int) -> int:
    hf = layers_from_hf(_config())
    if cp > 1:
        hf = context_parallel_hf(hf)
    module = PipelineModule(hf.layers, num_stages=1, loss_fn=hf.loss_fn)
    engine = PipelineEngine(module, num_microbatches=1, timeout=60, context_parallel=cp,
                            data_parallel=dist.get_world_size() // cp,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    ids, _ = token_batch(B, S, seed=2)  # every rank the same batch
    targets = causal_lm_targets(ids)
    engine.train_batch(ids, targets)  # warm-up: buffers built
    with SavedTensorMeter(ignore=[*module.parameters(), ids, targets]) as meter:
        engine.train_batch(ids, targets)
    engine.stop_watchdog()
    return meter.peak


def count_cp_activations() -> list[CPCount]:
    """On each of 4 launched ranks: every cp size's counted and predicted bytes."""
    torch.set_num_threads(1)
    counts = []
    for cp in SIZES:
        counts.append(CPCount(cp, _counted(cp), predicted_cp_activations(cp)))
        dist.barrier()
    return counts
