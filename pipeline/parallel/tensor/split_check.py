"""Refuse tensor parallelism over layers that would silently run whole on every tp rank.

At tp > 1 a layer that holds trainable parameters but splits none of them (no parameter
marked by `mark_tensor_parallel`) computes the same thing on every tp rank: the run is
correct but replicated, with no memory or compute saved. That is right for a few small
layers (a position embedding, a final norm: Megatron replicates them too), which say so with
`mark_replicated`; any other such layer is a model nobody parallelised (a plain
``nn.Linear``, a `layers_from_hf` block before `tensor_parallel_hf`), refused by name.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist
from torch import nn

from pipeline.errors import PipelineConfigError
from pipeline.parallel.param_marks import is_tensor_parallel

__all__ = ["check_layers_split", "is_marked_replicated", "mark_replicated", "unsplit_layers"]

_REPLICATED = "pipesched_tensor_parallel_replicated"


def mark_replicated(module: nn.Module) -> nn.Module:
    """Declare that `module` runs whole on every tp rank on purpose (returns it)."""
    setattr(module, _REPLICATED, True)
    return module


def is_marked_replicated(module: nn.Module) -> bool:
    return bool(getattr(module, _REPLICATED, False))


def _is_split(layer: nn.Module) -> bool:
    """Whether the layer splits a parameter over tp, or (itself or a wrapped module) is
    marked replicated."""
    if any(is_marked_replicated(m) for m in layer.modules()):
        return True
    return any(is_tensor_parallel(p) for p in layer.parameters())


def unsplit_layers(layers: Iterable[tuple[int, nn.Module]]) -> list[str]:
    """One description per (global index, layer) that holds trainable parameters, splits
    none over tp and is not marked replicated."""
    problems = []
    for index, layer in layers:
        count = sum(p.numel() for p in layer.parameters() if p.requires_grad)
        if count and not _is_split(layer):
            inner = getattr(layer, "layer", None)
            name = type(layer).__name__ + (f"({type(inner).__name__})"
                                           if isinstance(inner, nn.Module) else "")
            problems.append(f"layer {index} ({name}, {count:,} parameters)")
    return problems


def check_layers_split(layers: Iterable[tuple[int, nn.Module]], tp: int,
                       gather: bool = True) -> None:
    """At tp > 1, raise `PipelineConfigError` naming every layer that `unsplit_layers`
    finds, on every rank alike (with `gather`, the descriptions of all ranks are collected
    over the default group first, so no rank goes on into the step's collectives alone)."""
    if tp == 1:
        return
    found = unsplit_layers(layers)
    if gather and dist.is_initialized():
        everyone: list[list[str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, found)
        found = sorted({problem for part in everyone for problem in part or []},
                       key=lambda text: int(text.split()[1]))
    if found:
        raise PipelineConfigError(
            f"tensor_parallel={tp} but {'; '.join(found)} split no parameter over the tp "
            "ranks: each would run whole on every tp rank (replicated work, no memory saved). "
            "Build the tensor-parallel form of the model (for layers_from_hf: "
            "pipeline.interop.hf_tensor_parallel.tensor_parallel_hf(hf); for your own "
            "layers: ColumnParallelLinear / RowParallelLinear / VocabParallelEmbedding from "
            "pipeline.parallel.tensor.layers), mark a layer meant to be replicated with "
            "pipeline.parallel.tensor.split_check.mark_replicated, or use tensor_parallel=1")
