"""A mixture-of-experts stage's expert all-to-all: the costs the simulator and the planner share.

The rule the simulator prices it by (`simulate` with `CostModel(all_to_all=...)`), and the
order the engine's overlapped pair follows (`pipeline.moe.interleave`). Each rank has one
compute stream and one all-to-all lane; a stage's MoE layers are read as one, so an op is a
chain of four parts (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, §3.2.1 and its
Figure 4, https://arxiv.org/abs/2412.19437), the compute c and the all-to-all a each cut in
two equal halves:

    F:  attention c/2 ─▶ dispatch a/2 ─▶ experts c/2 ─▶ combine a/2
    B:  combine' a/2 ─▶ experts' c/2 ─▶ dispatch' a/2 ─▶ attention' c/2   (' : backward)

An ordinary F or B (or I) runs its chain alone: c + a, every all-to-all exposed. An
overlapped pair (F, OVERLAP_B: DualPipe's F&B) interleaves the two chains as DeepSeek's
Figure 4 does, one microbatch's all-to-all in flight while the other computes:

    compute:  F.attention   B.experts'   F.experts    B.attention'
    lane:     B.combine'    F.dispatch   B.dispatch'  F.combine

Each part starts when the part before it in its own chain has ended and its resource (the
compute stream or the lane) is free of the part before it in the order above; the pair ends
with its last part. With no all-to-all (a = 0) the pair costs F + B, as back to back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

__all__ = [
    "PAIR_ORDER",
    "CommSpan",
    "ExpertAllToAll",
    "PairSchedule",
    "op_spans",
    "overlapped_pair",
]

PerStage = float | Sequence[float]


@dataclass(frozen=True, kw_only=True)
class ExpertAllToAll:
    """Seconds of expert-parallel all-to-all (token dispatch + combine, summed over the MoE
    layers of a stage) inside one microbatch's F and inside its B, a number for every stage or
    one per stage. A stage without MoE layers has 0."""

    forward: PerStage = 0.0
    """All-to-all time inside one F of a stage (dispatch + combine of its MoE layers)."""
    backward: PerStage = 0.0
    """All-to-all time inside one B (or I, when split) of a stage; W has none."""


Op = Literal["F", "B"]
Resource = Literal["compute", "lane"]

PAIR_ORDER: tuple[tuple[Op, Resource, int], ...] = (
    ("B", "lane", 0), ("F", "compute", 0), ("B", "compute", 0), ("F", "lane", 0),
    ("F", "compute", 1), ("B", "lane", 1), ("B", "compute", 1), ("F", "lane", 1))
"""The overlapped pair's eight parts (op, resource, which half) in the order they are issued:
on each resource they run in this order, and it respects each chain's own order."""


class CommSpan(NamedTuple):
    """One all-to-all part on the lane, offsets from its op's (or pair's) start."""

    op: Op
    start: float
    end: float


class PairSchedule(NamedTuple):
    """An overlapped pair laid out by `overlapped_pair`."""

    end: float
    """The pair's time: from its start until its last part ends."""
    forward_end: float
    """When F's last part ends (its output can leave)."""
    lane: tuple[CommSpan, ...]
    """The four all-to-all parts, in lane order."""


def _check(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")


def op_spans(op: Op, compute: float, all_to_all: float) -> tuple[CommSpan, ...]:
    """The two all-to-all parts of an F or B run alone (its chain in the module docstring);
    the op lasts compute + all_to_all."""
    _check("compute", compute)
    _check("all_to_all", all_to_all)
    c, a = compute / 2, all_to_all / 2
    if op == "F":  # attention, dispatch, experts, combine
        return CommSpan("F", c, c + a), CommSpan("F", 2 * c + a, 2 * (c + a))
    return CommSpan("B", 0.0, a), CommSpan("B", a + c, 2 * a + c)


def overlapped_pair(forward_compute: float, forward_all_to_all: float,
                    backward_compute: float, backward_all_to_all: float) -> PairSchedule:
    """An F and a B of other microbatches interleaved on one rank (module docstring)."""
    for name, value in (("forward_compute", forward_compute),
                        ("forward_all_to_all", forward_all_to_all),
                        ("backward_compute", backward_compute),
                        ("backward_all_to_all", backward_all_to_all)):
        _check(name, value)
    half = {("F", "compute"): forward_compute / 2, ("F", "lane"): forward_all_to_all / 2,
            ("B", "compute"): backward_compute / 2, ("B", "lane"): backward_all_to_all / 2}
    chain_end: dict[str, float] = {"F": 0.0, "B": 0.0}
    free: dict[str, float] = {"compute": 0.0, "lane": 0.0}
    lane: list[CommSpan] = []
    for op, resource, _ in PAIR_ORDER:
        start = max(chain_end[op], free[resource])
        end = start + half[(op, resource)]
        chain_end[op] = free[resource] = end
        if resource == "lane":
            lane.append(CommSpan(op, start, end))
    return PairSchedule(max(chain_end.values()), chain_end["F"], tuple(lane))
