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
with its last part. An op whose stage has no all-to-all (a = 0: no MoE layer) has no point
to hand the turn over at, so it runs whole once it holds the turn, as the engine runs it: a
dense B (it starts) runs whole, then F with its all-to-all exposed; a dense F runs whole while
B's first all-to-all is in flight. With no all-to-all on either side the pair costs F + B, as
back to back. Every layout here is the engine's turn protocol (`pipeline.moe.interleave`)
played out on the op's chains (`_take_turns`): the orders above are what it yields.

Two-batch overlap (`ExpertAllToAll.two_batch`, the engine's `two_batch_overlap`; SGLang's
two-batch overlap, DeepSeek-V3 §3.4's two micro-batches): an F outside a pair runs as two
halves of its microbatch, X and Y, each a chain of quarters (c/4, a/4, c/4, a/4) on its own
thread, taking turns: a half computes until it launches an all-to-all, then hands the turn
over; the lane runs the exchanges in launch order. Its eight parts are issued as

    (X, compute, 0), (X, lane, 0), (Y, compute, 0), (Y, lane, 0),
    (X, compute, 1), (X, lane, 1), (Y, compute, 1), (Y, lane, 1)

under the same rule; the F ends when both halves have (c = a = 2: 2.5, not 4). B, I and W
are not split. An F inside a pair runs its halves one after the other on the pair's forward
thread, and the pair's backward (of a forward run as halves) hands over at each half's
all-to-all: `PAIR_ORDER` twice at half size, which ends when the whole pair does, so a pair
is priced as without two-batch, except where one side is dense: then the other side's
halves expose all their all-to-alls but the first (`overlapped_pair(..., two_batch=True)`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

__all__ = [
    "PAIR_ORDER",
    "TWO_BATCH_ORDER",
    "CommSpan",
    "ExpertAllToAll",
    "PairSchedule",
    "op_spans",
    "overlapped_pair",
    "two_batch_forward",
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
    two_batch: bool = False
    """An F outside an overlapped pair runs as two half-microbatches taking turns at their
    all-to-alls (the engine's `two_batch_overlap`; `two_batch_forward` prices it)."""


Op = Literal["F", "B"]
Resource = Literal["compute", "lane"]
Half = Literal["X", "Y"]

PAIR_ORDER: tuple[tuple[Op, Resource, int], ...] = (
    ("B", "lane", 0), ("F", "compute", 0), ("B", "compute", 0), ("F", "lane", 0),
    ("F", "compute", 1), ("B", "lane", 1), ("B", "compute", 1), ("F", "lane", 1))
"""The overlapped pair's eight parts (op, resource, which half) in the order they are issued:
on each resource they run in this order, and it respects each chain's own order."""

TWO_BATCH_ORDER: tuple[tuple[Half, Resource, int], ...] = (
    ("X", "compute", 0), ("X", "lane", 0), ("Y", "compute", 0), ("Y", "lane", 0),
    ("X", "compute", 1), ("X", "lane", 1), ("Y", "compute", 1), ("Y", "lane", 1))
"""A two-batch F's eight parts (half, resource, which part) in the order they are issued:
X starts, and each half hands the turn over when it launches an all-to-all."""


class CommSpan(NamedTuple):
    """One all-to-all part on the lane, offsets from its op's (or pair's) start."""

    op: Op
    start: float
    end: float


class PairSchedule(NamedTuple):
    """An overlapped pair laid out by `overlapped_pair` (or a two-batch F by
    `two_batch_forward`)."""

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
                    backward_compute: float, backward_all_to_all: float, *,
                    two_batch: bool = False) -> PairSchedule:
    """An F and a B of other microbatches interleaved on one rank (module docstring); with
    `two_batch`, each op of a stage with an all-to-all runs as its two halves in turn."""
    for name, value in (("forward_compute", forward_compute),
                        ("forward_all_to_all", forward_all_to_all),
                        ("backward_compute", backward_compute),
                        ("backward_all_to_all", backward_all_to_all)):
        _check(name, value)
    pieces = 4 if two_batch else 2
    chains = (_chain("B", backward_compute, backward_all_to_all, pieces),  # B starts
              _chain("F", forward_compute, forward_all_to_all, pieces))
    (backward_end, forward_end), lane = _take_turns(chains)
    return PairSchedule(max(backward_end, forward_end), forward_end,
                        tuple(CommSpan("B" if chain == 0 else "F", start, end)
                              for chain, start, end in lane))


Part = tuple[Resource, float]


def _chain(op: Op, compute: float, all_to_all: float, pieces: int) -> list[Part]:
    """An op's parts in its own order, its compute and all-to-all each cut in `pieces` (2:
    the chain of the module docstring; 4: that chain for each half of a two-batch op); an op
    with no all-to-all is one part: nothing in it hands the turn over."""
    if all_to_all == 0:
        return [("compute", compute)]
    c, a = compute / pieces, all_to_all / pieces
    pair: list[Part] = [("compute", c), ("lane", a)] if op == "F" else [("lane", a), ("compute", c)]
    return pair * pieces


def _take_turns(chains: Sequence[Sequence[Part]]
                ) -> tuple[list[float], list[tuple[int, float, float]]]:
    """The engine's turn protocol (`pipeline.moe.interleave`) played out: chain 0 holds the
    turn first; the holder computes until it launches an all-to-all (on the one lane, in
    launch order), then hands the turn to the other chain unless that one has ended, and
    once the turn is back waits for its all-to-all; an ended chain hands the turn over.
    Each chain's end, and the lane's parts (chain, start, end) in lane order."""
    position = [0] * len(chains)
    ends = [0.0] * len(chains)
    waiting = [0.0] * len(chains)   # when the all-to-all a chain launched last ends
    done = [not chain for chain in chains]
    lane: list[tuple[int, float, float]] = []
    lane_free = clock = 0.0
    me = 0
    while not all(done):
        clock = max(clock, waiting[me])
        while position[me] < len(chains[me]):
            resource, cost = chains[me][position[me]]
            position[me] += 1
            if resource == "compute":
                clock += cost
                continue
            start = max(clock, lane_free)
            lane_free = waiting[me] = start + cost
            lane.append((me, start, lane_free))
            if not done[1 - me]:
                break                           # the other computes while this is in flight
            clock = max(clock, waiting[me])
        else:
            done[me], ends[me] = True, max(clock, waiting[me])
            clock = ends[me]
        if not done[1 - me]:
            me = 1 - me
    return ends, lane


def two_batch_forward(compute: float, all_to_all: float) -> PairSchedule:
    """An F outside a pair run as two half-microbatches taking turns (module docstring): its
    time (`forward_end` too), and its four all-to-all parts (op F) in lane order."""
    _check("compute", compute)
    _check("all_to_all", all_to_all)
    half = _chain("F", compute / 2, all_to_all / 2, 2)
    ends, lane = _take_turns((half, half))
    end = max(ends)
    return PairSchedule(end, end, tuple(CommSpan("F", start, stop) for _, start, stop in lane))
