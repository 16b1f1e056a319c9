"""Which context-parallel sizes a search tries, and why its pick splits sequences."""

from __future__ import annotations

from dataclasses import replace

from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.errors import PlanError
from pipeline.planner.options import SearchOptions
from pipeline.planner.profile import ModelProfile
from pipeline.planner.search import plan

__all__ = ["context_sizes", "why_context_parallel"]


def context_sizes(sizes: tuple[int, ...] | None, maximum: int, seq: int, devices: int
                  ) -> tuple[int, ...]:
    """The cp sizes a search tries: `sizes` as given (the search checks them), or every cp
    up to `maximum` that divides the devices and cuts the sequence into 2·cp chunks."""
    if sizes is not None:
        return sizes
    return tuple(cp for cp in range(1, maximum + 1)
                 if cp == 1 or (devices % cp == 0 and seq % (2 * cp) == 0))


def why_context_parallel(cp: int, model: ModelProfile, cluster: ClusterSpec,
                         global_batch: int, precision: str, options: SearchOptions) -> str:
    """One line: why a pick splits sequences over `cp` ranks: memory (a search without
    context parallelism finds nothing that fits) or time (its fastest is slower)."""
    try:
        plain = plan(model, cluster, global_batch, precision=precision,
                     options=replace(options, context_parallel=(1,), top=1))
    except PlanError:
        return (f"why cp{cp}: memory: no configuration without context parallelism fits in "
                f"{cluster.device_memory / 2**30:.0f} GiB per device")
    return (f"why cp{cp}: time: the fastest without context parallelism "
            f"({plain.best.config.label()}) takes {plain.best.step_seconds:.3f} s a step")
