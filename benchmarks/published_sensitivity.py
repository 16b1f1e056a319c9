"""Where the planner and the Megatron-LM paper's Table 1 disagree (`bench_published.py`): what
would have to be true for the paper's (t, p) to come within 3 % of the planner's pick.

For each row where it does not, two questions, each answered by re-running the same searches
with one input changed:
- memory: the largest usable memory per device (GiB) at which the paper's (t, p) is within
  3 % of the pick, found by bisection between the paper's own configuration's need and the
  device's memory (the search's verdict is taken as monotone in it); "none" when even
  memory just large enough for the paper's configuration leaves it more than 3 % behind;
- NVLink: the gap with every collective inside a node free (bandwidth unbounded, no
  latency), the most tensor parallelism could gain from a faster node.

    PYTHONPATH=. python benchmarks/bench_plan.py --part published
"""

from __future__ import annotations

from dataclasses import replace

from bench_published import MEGATRON_2021, ROWS, PublishedRow, _model, _short

from pipeline.planner import PRESETS, ClusterSpec, PlanError, SearchOptions, plan
from pipeline.planner.cluster import GIB
from pipeline.planner.predict import Prediction
from pipeline.planner.search import price

__all__ = ["disagreement_part", "paper_gap"]

CLOSE = 0.03
_STEPS = 10


def _searches(row: PublishedRow, cluster: ClusterSpec) -> tuple[Prediction | None, Prediction]:
    """The planner's best at the paper's (t, p) (None: nothing there fits) and its pick."""
    model = _model(row)
    pick = plan(model, cluster, row.batch, precision="fp16",
                options=SearchOptions(**MEGATRON_2021)).best
    try:
        own = plan(model, cluster, row.batch, precision="fp16", options=SearchOptions(
            tensor_parallel=(row.tp,), pipeline_parallel=(row.pp,), **MEGATRON_2021)).best
    except PlanError:
        return None, pick
    return own, pick


def paper_gap(row: PublishedRow, cluster: ClusterSpec) -> float | None:
    """How much slower the planner's best at the paper's (t, p) is than its pick on
    `cluster` (None: nothing at the paper's (t, p) fits)."""
    own, pick = _searches(row, cluster)
    return None if own is None else own.step_seconds / pick.step_seconds - 1


def _usable_memory(row: PublishedRow, cluster: ClusterSpec) -> float | None:
    """The largest device memory at which the paper's (t, p) is within `CLOSE` of the pick,
    to 1/2^_STEPS of the range (None: none in it)."""
    need = price(_model(row), cluster, row.batch, row.config(), precision="fp16",
                 options=SearchOptions(**MEGATRON_2021)).memory.total
    low, high = need, cluster.device_memory

    def close(memory: float) -> bool:
        gap = paper_gap(row, replace(cluster, device_memory=memory))
        return gap is not None and gap <= CLOSE

    if not close(low):
        return None
    for _ in range(_STEPS):
        middle = (low + high) / 2
        low, high = (middle, high) if close(middle) else (low, middle)
    return low


def disagreement_part(rows: tuple[PublishedRow, ...] = ROWS) -> list[str]:
    """A line per row where the paper's (t, p) is more than 3 % behind the pick."""
    lines = ["Where the paper's (t, p) is more than 3% behind the pick: the usable memory per "
             "device at which it would be within 3%, and the gap with free NVLink", "",
             "| model | paper's run | gap | pick | pick's memory GiB | agrees at usable "
             "memory <= GiB | gap, NVLink free |", "|---|---|---:|---|---:|---:|---:|"]
    for row in rows:
        cluster = replace(PRESETS["a100-80g"], nodes=row.gpus // 8)
        own, pick = _searches(row, cluster)
        gap = None if own is None else own.step_seconds / pick.step_seconds - 1
        if gap is None or gap <= CLOSE:
            continue
        usable = _usable_memory(row, cluster)
        free = paper_gap(row, replace(cluster, intra_bandwidth=1e18, intra_latency=0.0))
        lines.append(f"| {row.billions}B | {_short(row.config())} | {gap:+.1%} | "
                     f"{_short(pick.config)} | {pick.memory.total / GIB:.1f} | "
                     f"{'none' if usable is None else f'{usable / GIB:.1f}'} | "
                     f"{'-' if free is None else f'{free:+.1%}'} |")
    return lines
