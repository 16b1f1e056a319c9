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
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)
