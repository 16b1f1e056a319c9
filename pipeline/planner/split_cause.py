"""When an engine that splits the blocks evenly finds nothing that fits: whether the split,
not the model's size, is the cause (a pipeline size the split refuses would fit)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from pipeline.planner.bounds import SearchBounds
from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.config import PlanConfig
from pipeline.planner.grid import configurations, engine_refuses
from pipeline.planner.options import SearchOptions
from pipeline.planner.predict import PlanContext
from pipeline.planner.profile import ModelProfile
from pipeline.planner.stages import block_span

__all__ = ["UnevenFit", "split_message", "uneven_fit"]

GIB = 2**30

UnevenFit = tuple[PlanConfig, float]
"""A configuration the engine's even split refuses, and its memory floor (bytes) with the
blocks cut by the exact partitioner instead."""


def uneven_fit(model: ModelProfile, cluster: ClusterSpec, global_batch: int,
               options: SearchOptions,
               context_of: Callable[[SearchOptions], PlanContext]) -> UnevenFit | None:
    """Of the configurations the options' even split (`uniform_layers`: p·v must divide the
    blocks) refused, their floors priced with a balanced split (`context_of` builds the
    pricing context of given options): the one with the fewest stages among those that fit
    the device (the leanest of those), or the leanest if none fits; None when the options
    split freely or the split refused nothing. Asked only once a search found nothing that
    fits."""
    if not options.uniform_layers:
        return None
    free = replace(options, uniform_layers=False)
    bounds = SearchBounds(context_of(free))
    first, end = block_span(model.layers)
    best: UnevenFit | None = None
    rank = None
    for config in configurations(model, cluster, global_batch, free):
        if engine_refuses(options, end - first, config.pp, config.schedule, config.chunks,
                          config.num_microbatches) != "uniform":
            continue
        floor = bounds.memory_floor(config)
        key = (floor > cluster.device_memory, config.pp * config.chunks, floor)
        if rank is None or key < rank:
            best, rank = (config, floor), key
    return best


def split_message(model: ModelProfile, cluster: ClusterSpec, leanest: tuple[PlanConfig, float],
                  uneven: UnevenFit, blocks: int, grid: list[tuple[int, int, int]]) -> str:
    """The refusal naming the even split as the cause: the leanest configuration the engine
    runs does not fit, one that only the split refuses does. `grid`: the (tp, pp, dp) the
    devices allow (`SearchLog.grid`)."""
    config, floor = leanest
    other, other_floor = uneven
    allowed = sorted({pp for _, pp, _ in grid if blocks % pp == 0})
    device_memory = cluster.device_memory
    where = (f"{model.name} on {cluster.num_devices} × {device_memory / GIB:.1f} GiB "
             f"devices")
    return (f"{where} does not fit because of the engine's even layer split, not the model's "
            f"size: it splits the {blocks} blocks evenly over p·v stages (p·v must divide "
            f"{blocks}; Megatron-Core: \"number of layers should be divisible by the "
            f"pipeline-model-parallel size\"), which with these devices leaves pipeline sizes "
            f"{', '.join(map(str, allowed)) or 'none'}; the leanest configuration it can run "
            f"({config.label()}) needs {floor / GIB:.1f} GiB per device > "
            f"{device_memory / GIB:.1f} GiB, while {other.label()}, refused only for its "
            f"split ({blocks} blocks over {other.pp * other.chunks} stages), would need "
            f"{other_floor / GIB:.1f} GiB with the blocks split unevenly (Megatron-Core: "
            f"--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers, not "
            f"searched); use a layer count that pp {other.pp} divides, or --engine pipesched "
            f"(which cuts the blocks unevenly)")
