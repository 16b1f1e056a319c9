"""Activation bytes one rank saves for backward at cp = 2 against cp = 1 (test helper)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from pipeline import PipelineEngine, PipelineModule
from pipeline.interop.hf_context_parallel import context_parallel_hf
from pipeline.interop.hf_layers import causal_lm_targets, layers_from_hf
from pipeline.runtime.saved_memory import SavedTensorMeter
from tests.support.hf_models import tiny_config, token_batch

__all__ = ["saved_activation_bytes"]


def _peak(parallel: dict[str, int], length: int) -> int:
    hf = context_parallel_hf(layers_from_hf(tiny_config("llama", tied=False)))
    module = PipelineModule(hf.layers, num_stages=2, loss_fn=hf.loss_fn,
                            partition_method="uniform")
    engine = PipelineEngine(module, num_microbatches=2, timeout=60, **parallel,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    ids, _ = token_batch(4, length, seed=2)  # every rank the same batch (dp: the same too)
    engine.train_batch(ids, causal_lm_targets(ids))  # warm-up: shapes traced, buffers built
    with SavedTensorMeter(ignore=list(module.parameters())) as meter:
        engine.train_batch(ids, causal_lm_targets(ids))
    return meter.peak


def saved_activation_bytes(length: int = 64) -> tuple[int, int]:
    """On 4 ranks: (peak bytes saved for backward by this rank at pp 2 × cp 2, the same at
    pp 2 × dp 2 where every replica passes the same whole batch, i.e. one rank at cp = 1)."""
    torch.set_num_threads(1)
    split = _peak({"context_parallel": 2}, length)
    dist.barrier()
    whole = _peak({"data_parallel": 2}, length)
    return split, whole
