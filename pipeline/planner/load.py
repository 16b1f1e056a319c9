"""Read the planner's MODEL argument: a partitioner cost JSON, or a transformer shape."""

from __future__ import annotations

import os

from pipeline.planner.errors import PlanError
from pipeline.planner.hf_activations import hf_eager_profile
from pipeline.planner.hf_config import is_hf_config, read_hf_config, shape_from_hf_config
from pipeline.planner.input_files import MAX_INPUT_BYTES, read_input_json
from pipeline.planner.limits import MAX_LAYERS
from pipeline.planner.profile import ModelProfile, profile_from_cost_json
from pipeline.planner.shape_parse import parse_shape
from pipeline.planner.transformer_layers import transformer_profile

__all__ = ["MAX_INPUT_BYTES", "load_model", "read_input_json"]

def load_model(text: str, *, seq: int | None = None, precision: str = "bf16",
               cost_batch: int = 1, attention: str = "fused",
               sequence_parallel: bool = False, engine: str = "pipesched",
               hf_eager: bool = True) -> ModelProfile:
    """`text` is a cost JSON file (a top-level "layers" list, partition/README.md), a HF
    model's config.json or its directory (`hf_config`), a JSON file of a transformer shape,
    or a shape written inline
    (``layers=24,hidden=2048,heads=16,vocab=50257,seq=2048``); `attention`,
    `sequence_parallel` and `engine` as `transformer_profile` takes them. A HF config's
    blocks are priced as this engine runs them, HF's eager modules
    (`hf_activations.hf_eager_profile`), when `hf_eager`; else as Megatron's fused layer
    (another engine's own layers)."""
    family, config = None, None
    if os.path.isdir(text):
        config = read_hf_config(text)
        family = config["model_type"]
        shape = shape_from_hf_config(config, seq=seq, where=text)
    elif os.path.exists(text):
        document = read_input_json(text, "model file")
        if isinstance(document, dict) and isinstance(document.get("layers"), list):
            if seq is not None:
                raise PlanError(f"--seq {seq} does not apply to a cost file ({text}); its "
                                f"times already fix the sequence length")
            _check_layers(len(document["layers"]), text)
            return profile_from_cost_json(document, cost_batch=cost_batch)
        if not isinstance(document, dict):
            raise PlanError(f"model file {text!r} must hold a JSON object")
        if is_hf_config(document):
            family, config = document["model_type"], document
            shape = shape_from_hf_config(document, seq=seq, where=text)
        else:
            shape = parse_shape(document, seq=seq)
    elif "=" not in text:
        raise PlanError(f"model {text!r} is neither an existing file nor a shape such as "
                        f"layers=24,hidden=2048,heads=16,vocab=50257,seq=2048")
    else:
        shape = parse_shape(text, seq=seq)
    _check_layers(shape.layers, text)  # before a profile of that many layers is built
    profile = transformer_profile(shape, precision, attention=attention,
                                  sequence_parallel=sequence_parallel, engine=engine)
    if config is None or not hf_eager:
        return profile
    windowed = family != "qwen2" or config.get("use_sliding_window")
    window = config.get("sliding_window") if windowed else None
    return hf_eager_profile(profile, shape, str(family), sequence_parallel=sequence_parallel,
                            sliding_window=window if isinstance(window, int) else None)


def _check_layers(count: int, text: str) -> None:
    if count > MAX_LAYERS:
        raise PlanError(f"model {text[:80]!r} has {count:,} layers, over the planner's limit "
                        f"of {MAX_LAYERS:,}; plan a model with fewer layers")
