"""pipesched's runtime: `PipelineModule`, `PipelineEngine` and `launch`.

Names are imported lazily so that `pipeline.cli` (simulate, schedule, partition) starts
without importing torch.

Four modules stand at the top, below every room, because every room uses them: `errors`
holds the typed errors raised from the device seam to the CLI; `limits` bounds a run
(timeouts, local ranks, run length) for the device seam, launcher, runtime, planner and CLI
before anything starts; `files` reads any file a user names (checkpoints, plans, configs)
bounded and without blocking; `recompute_region` is the mark layers of any room (the
tensor-parallel block, the demo's, Hugging Face's) put on the part selective recomputation
drops. The accelerator seam and its staged backend are the `device` room.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> module that defines it (imported on first use: `import pipeline` stays
# free of torch)
_LAZY: dict[str, str] = {
    "PipelineModule": "pipeline.model.module",
    "Stage": "pipeline.model.stage",
    "LayerSpec": "pipeline.model.layers",
    "PipelineEngine": "pipeline.runtime.engine",
    "launch": "pipeline.launcher.processes",
    "LaunchCheck": "pipeline.runtime.launch_check",
    "Progress": "pipeline.runtime.training_progress",
    "ProgressReporter": "pipeline.runtime.training_progress",
    "GradReducer": "pipeline.parallel.data_parallel",
    "StepStats": "pipeline.runtime.trace",
    "OpCosts": "pipeline.runtime.trace",
    "measured_costs": "pipeline.runtime.trace",
    "torch_runtime": "pipeline.interop.torch_pipelining",
    # DeepSpeed's entry point and HF adapters (transformers only when these are used)
    "initialize": "pipeline.interop.deepspeed_compat",
    "RepeatingLoader": "pipeline.interop.ds_engine",
    "layers_from_hf": "pipeline.interop.hf_layers",
    "load_hf_weights": "pipeline.interop.hf_weights",
    "gather_hf_state_dict": "pipeline.interop.hf_weights",
    "save_hf_checkpoint": "pipeline.interop.hf_weights",
    "token_cross_entropy": "pipeline.runtime.loss_normalization",
    "normalized_train_batch": "pipeline.runtime.loss_normalization",
    "torch_stages": "pipeline.interop.torch_pipelining",
    "reference_step": "pipeline.model.reference",
    "reference_forward": "pipeline.model.reference",
    "build_reference": "pipeline.model.reference",
    "ReferenceResult": "pipeline.model.reference",
    "CheckpointError": "pipeline.errors",
    "CheckpointInfo": "pipeline.checkpoint.parts",
    "CheckpointRootLockedError": "pipeline.checkpoint.root_lock",
    "PipelineError": "pipeline.errors",
    "NonFiniteError": "pipeline.errors",
    "PipelineConfigError": "pipeline.errors",
    "PipelineStepError": "pipeline.errors",
    "PipelineLayerError": "pipeline.errors",
    "RankFailedError": "pipeline.errors",
    "Topology": "pipeline.parallel.topology",
    "TopologyError": "pipeline.parallel.topology",
    # 3D parallelism: data / tensor parallel, ZeRO-1, tied layers, mixed precision
    "EngineConfig": "pipeline.runtime.config",
    "ParallelConfig": "pipeline.parallel.config",
    "ZeroStage": "pipeline.parallel.config",
    "ZeroStageError": "pipeline.parallel.config",
    "ProcessGroups": "pipeline.parallel.groups",
    "current_process_groups": "pipeline.model.build_context",
    "TiedLayerSpec": "pipeline.model.tied",
    "ShardedOptimizer": "pipeline.parallel.zero",
    "DynamicLossScaler": "pipeline.parallel.precision",
    "Precision": "pipeline.parallel.precision",
    "OptimizerStep": "pipeline.parallel.optimizer_step",
    "ColumnParallelLinear": "pipeline.parallel.tensor.layers",
    "RowParallelLinear": "pipeline.parallel.tensor.layers",
    "VocabParallelEmbedding": "pipeline.parallel.tensor.layers",
    "ParallelTransformerBlock": "pipeline.parallel.tensor.layers",
    "TransformerBlock": "pipeline.parallel.tensor.layers",
    "parallel_lm_logits": "pipeline.parallel.tensor.layers",
    "ScatterSequence": "pipeline.parallel.tensor.sequence",
    "GatherSequence": "pipeline.parallel.tensor.sequence",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)
