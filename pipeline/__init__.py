"""pipesched's runtime: `PipelineModule`, `PipelineEngine` and `launch`.

Names are imported lazily so that `pipeline.cli` (simulate, schedule, partition) starts
without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> module that defines it (imported on first use: `import pipeline` stays
# free of torch)
_LAZY: dict[str, str] = {
    "PipelineModule": "pipeline.module",
    "Stage": "pipeline.module",
    "LayerSpec": "pipeline.layers",
    "PipelineEngine": "pipeline.engine",
    "launch": "pipeline.launcher",
    "GradReducer": "pipeline.data_parallel",
    "StepStats": "pipeline.trace",
    "OpCosts": "pipeline.trace",
    "measured_costs": "pipeline.trace",
    "torch_runtime": "pipeline.torch_pipelining",
    "torch_stages": "pipeline.torch_pipelining",
    "reference_step": "pipeline.reference",
    "reference_forward": "pipeline.reference",
    "build_reference": "pipeline.reference",
    "ReferenceResult": "pipeline.reference",
    "CheckpointError": "pipeline.errors",
    "CheckpointInfo": "pipeline.checkpoint",
    "PipelineError": "pipeline.errors",
    "PipelineConfigError": "pipeline.errors",
    "PipelineStepError": "pipeline.errors",
    "RankFailedError": "pipeline.errors",
    "Topology": "pipeline.topology",
    "TopologyError": "pipeline.topology",
    # 3D parallelism: data / tensor parallel, ZeRO-1, tied layers, mixed precision
    "ParallelConfig": "pipeline.parallel_setup",
    "ProcessGroups": "pipeline.groups",
    "ZeroStageError": "pipeline.groups",
    "current_process_groups": "pipeline.build_context",
    "TiedLayerSpec": "pipeline.tied",
    "ShardedOptimizer": "pipeline.zero",
    "DynamicLossScaler": "pipeline.precision",
    "Precision": "pipeline.precision",
    "OptimizerStep": "pipeline.optimizer_step",
    "ColumnParallelLinear": "pipeline.tp_layers",
    "RowParallelLinear": "pipeline.tp_layers",
    "VocabParallelEmbedding": "pipeline.tp_layers",
    "ParallelTransformerBlock": "pipeline.tp_layers",
    "TransformerBlock": "pipeline.tp_layers",
    "parallel_lm_logits": "pipeline.tp_layers",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)
