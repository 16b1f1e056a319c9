"""Checkpoints keyed by global layer index, so a model saved under one partition loads under any.

As in DeepSpeed: one ``layer_XX-model_states.pt`` per layer, written by the rank that holds
it (data-parallel replica 0 only), read by whichever rank holds it when loading.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from pipeline.errors import PipelineConfigError
from pipeline.module import PipelineModule

__all__ = ["layer_file", "load_layers", "save_layers"]


def layer_file(directory: str, index: int) -> str:
    """Path of layer `index`'s weights."""
    return os.path.join(directory, f"layer_{index:02d}-model_states.pt")


def save_layers(module: PipelineModule, directory: str, *, writer: bool = True) -> None:
    """Write every layer this rank holds (when `writer`), then wait for every rank."""
    if writer:
        os.makedirs(directory, exist_ok=True)
        for stage in module.stages:
            for key, layer in module.stage(int(stage)).layers.items():
                state = {name: value.detach().cpu() for name, value in layer.state_dict().items()}
                if not state:
                    continue  # a parameter-free layer has nothing to keep
                torch.save(state, layer_file(directory, int(key)))
    if dist.is_initialized():
        dist.barrier()


def load_layers(module: PipelineModule, directory: str) -> None:
    """Load every layer this rank holds from `directory` (strict: names and shapes must match)."""
    missing = []
    for stage in module.stages:
        for key, layer in module.stage(int(stage)).layers.items():
            path = layer_file(directory, int(key))
            if not layer.state_dict():
                continue
            if not os.path.exists(path):
                missing.append(path)
                continue
            layer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    if missing:
        raise PipelineConfigError(f"checkpoint {directory!r} lacks {len(missing)} layer file(s), "
                                  f"e.g. {missing[0]}; was it saved from the same layer list?")
