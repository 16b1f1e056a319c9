"""Hugging Face attention cores as `recompute_region`s, so selective recomputation reaches them."""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from typing import Any

from pipeline.model.recompute import recompute_region

__all__ = ["mark_attention_cores"]

_MARK = "pipesched_recompute_region"
MARKED = ("sdpa", "eager")
"""Attention implementations whose core is marked (the CPU ones; others run unmarked)."""


def mark_attention_cores() -> None:
    """Wrap the `MARKED` implementations in transformers' attention registry (once per
    process): each call runs the core through `recompute_region`, which is a plain call
    outside a stage that recomputes selectively, so other uses of transformers see no change.

    The registry (``AttentionInterface``) is transformers' own extension point; the names are
    kept, because HF code also branches on ``config._attn_implementation == "eager"``. For
    "eager" the wrapper calls the attention module's own ``eager_attention_forward`` (each
    modeling file has its own, which the registry has no entry for).
    """
    registry: Any = importlib.import_module("transformers.modeling_utils").ALL_ATTENTION_FUNCTIONS
    for name in MARKED:
        current = registry.get(name)
        if getattr(current, _MARK, False):
            continue
        wrapper = functools.partial(_marked_core, current)
        setattr(wrapper, _MARK, True)
        registry[name] = wrapper


def _marked_core(base: Callable[..., Any] | None, module: Any, query: Any, key: Any, value: Any,
                 attention_mask: Any, **kwargs: Any) -> Any:
    function = base or sys.modules[type(module).__module__].eager_attention_forward

    def core(q: Any, k: Any, v: Any, mask: Any) -> Any:
        return function(module, q, k, v, mask, **kwargs)

    return recompute_region(core, query, key, value, attention_mask)
