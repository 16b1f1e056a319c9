"""Read the planner's MODEL argument: a partitioner cost JSON, or a transformer shape."""

from __future__ import annotations

import json
import os

from pipeline.planner.errors import PlanError
from pipeline.planner.profile import ModelProfile, profile_from_cost_json
from pipeline.planner.transformer import parse_shape, transformer_profile

__all__ = ["load_model"]


def load_model(text: str, *, seq: int | None = None, precision: str = "bf16",
               cost_batch: int = 1, attention: str = "fused",
               sequence_parallel: bool = False) -> ModelProfile:
    """`text` is a cost JSON file (a top-level "layers" list, partition/README.md), a JSON
    file of a transformer shape, or a shape written inline
    (``layers=24,hidden=2048,heads=16,vocab=50257,seq=2048``); `attention` and
    `sequence_parallel` as `transformer_profile` takes them."""
    if os.path.exists(text):
        try:
            with open(text) as handle:
                document = json.load(handle)
        except (OSError, json.JSONDecodeError) as error:
            raise PlanError(f"model file {text!r}: {error}") from None
        if isinstance(document, dict) and isinstance(document.get("layers"), list):
            if seq is not None:
                raise PlanError(f"--seq {seq} does not apply to a cost file ({text}); its "
                                f"times already fix the sequence length")
            return profile_from_cost_json(document, cost_batch=cost_batch)
        if not isinstance(document, dict):
            raise PlanError(f"model file {text!r} must hold a JSON object")
        return transformer_profile(parse_shape(document, seq=seq), precision, attention=attention,
                                   sequence_parallel=sequence_parallel)
    if "=" not in text:
        raise PlanError(f"model {text!r} is neither an existing file nor a shape such as "
                        f"layers=24,hidden=2048,heads=16,vocab=50257,seq=2048")
    return transformer_profile(parse_shape(text, seq=seq), precision, attention=attention,
                               sequence_parallel=sequence_parallel)
