"""pipesched's runtime: `PipelineModule`, `PipelineEngine` and `launch`.

Names are imported lazily so that `pipeline.cli` (simulate, schedule, partition) starts
without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__: list[str] = []

# public name -> module that defines it; filled in as the runtime lands
_LAZY: dict[str, str] = {}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)
