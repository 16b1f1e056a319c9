"""The Zero Bubble authors' V scheduler as their code runs it, and the costs their runtime feeds it.

Written from the algorithm of the public `zbv.py` (sail-sg/zero-bubble-pipeline-parallelism,
`PipelineGraph.try_v_schedule` and `create_schedule`), step for step, so that its plans are
candidates of `zb_v_auto` exactly as the authors' runtime would lay them out; none of its
code is copied. Where `authors_v_greedy` departs from that scheduler to find more orders
(an op may wait for a later round, extra warm-up rounds), this one does not: where the
original stops on an assertion it returns None, for every fill setting together, as
`create_schedule` would raise.

Legend: p ranks; rank r holds the down stage r and the up stage 2p-1-r; m microbatches.
The original numbers its ops (kind, chunk): F chunk 0 is the down stage's forward, F chunk
1 the up stage's; B and W count chunks in backward order, so B chunk 0 is the up stage's
input-gradient backward (our I) and B chunk 1 the down stage's. Memory in the original's
units: +f_mem at F, +b_mem at B, +w_mem at W, at most max_mem; here 1, 0, -1 and the
limit K, this package's count of stage activations.

Two feedings (`zbv_orders`): the true per-stage costs and per-edge delays (the original
takes one number per kind; each lookup below reads the cost of the op at hand, which is
the same when the costs are even), and the runtime's own: each rank's mean over its two
chunks, the (upper) median over ranks, at least 1 (`avg_then_mid`), and the delay at
least 1 (`update_schedule` passes ``max(c, 1)``).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from schedules.ir.instructions import NONE, Instruction, Kind, instruction_from

__all__ = ["ZbvCosts", "average_then_median", "zbv_order", "zbv_orders"]

_F, _B, _W = 0, 1, 2  # the original's categories; B is our I
_KINDS = (Kind.F, Kind.I, Kind.W)
_MAX_RETRIES = 200


class _Stop(Exception):
    """An assertion of the original failed: it lays out no schedule."""


@dataclass(frozen=True)
class ZbvCosts:
    """What the scheduler is fed, per stage (2p of them) and per stage edge."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    weight: tuple[float, ...]
    delay: tuple[float, ...]
    """delay[s]: the s <-> s+1 edge (the original's c)."""
    comm: float
    """The one c the original reads where no edge applies (a rank with nothing to wait for)."""

    @classmethod
    def even(cls, p: int, forward: float, backward: float, weight: float,
             comm: float) -> ZbvCosts:
        """One number per kind, as the original takes them."""
        return cls((forward,) * 2 * p, (backward,) * 2 * p, (weight,) * 2 * p,
                   (comm,) * 2 * p, comm)


def average_then_median(p: int, forward: Sequence[float], backward: Sequence[float],
                        weight: Sequence[float], delay: Sequence[float], *,
                        at_least: float = 1.0) -> ZbvCosts:
    """The runtime's feeding: per kind, each rank's mean over its two stages, then the upper
    median over ranks, at least `at_least` (the runtime: 1, for its times in its own unit);
    the delay (the median edge delay here) at least `at_least` too."""
    def middle(values: Sequence[float]) -> float:
        means = sorted((values[r] + values[2 * p - 1 - r]) / 2 for r in range(p))
        return max(means[p // 2], at_least)

    comm = max(sorted(delay[:2 * p - 1])[(2 * p - 1) // 2] if p > 1 else 0.0, at_least)
    return ZbvCosts.even(p, middle(forward), middle(backward), middle(weight), comm)


def zbv_orders(p: int, m: int, limit: int, costs: ZbvCosts) -> list[
        tuple[str, tuple[tuple[Instruction, ...], ...]]]:
    """The plans of the original's four fill settings, each with its retries on the
    approved bubble (`create_schedule` keeps the one of least bubble among them); empty
    when the original would stop on an assertion."""
    plans = []
    for fill_b, fill_f in itertools.product((True, False), (True, False)):
        try:
            plan, _ = _try_v_schedule(p, m, limit, costs, fill_f, fill_b, None)
        except _Stop:
            return []
        plans.append((f"zbv(fill_b={int(fill_b)}, fill_f={int(fill_f)})", _streams(p, plan)))
    return plans


def zbv_order(p: int, m: int, limit: int, costs: ZbvCosts) -> tuple[
        tuple[Instruction, ...], ...] | None:
    """The one plan `create_schedule` returns (least bubble over the four fill settings,
    the first on ties), or None where it stops on an assertion."""
    best: tuple[float, list[list[tuple[int, int, int]]]] | None = None
    for fill_b, fill_f in itertools.product((True, False), (True, False)):
        try:
            plan, bubble = _try_v_schedule(p, m, limit, costs, fill_f, fill_b, None)
        except _Stop:
            return None
        if best is None or bubble < best[0]:
            best = (bubble, plan)
    assert best is not None
    return _streams(p, best[1])


def _streams(p: int, plan: list[list[tuple[int, int, int]]]) -> tuple[
        tuple[Instruction, ...], ...]:
    """The original's (category, chunk, microbatch) per rank as our instructions."""
    return tuple(tuple(instruction_from((_KINDS[cat], _stage(p, r, cat, chunk), i, NONE))
                       for cat, chunk, i in ops) for r, ops in enumerate(plan))


def _stage(p: int, rank: int, cat: int, chunk: int) -> int:
    """Our stage of the original's op: F chunk 0 and B/W chunk 1 are the down stage."""
    down = chunk == 0 if cat == _F else chunk == 1
    return rank if down else 2 * p - 1 - rank


def _try_v_schedule(p: int, m: int, limit: int, costs: ZbvCosts, fill_f: bool, fill_b: bool,
                    approved: list[float] | None, depth: int = 0) -> tuple[
                        list[list[tuple[int, int, int]]], float]:
    """One `try_v_schedule`: (plan per rank, its largest bubble), retried on its own
    bubbles while the largest shrinks."""
    run = _Run(p, m, limit, costs, approved)
    run.lay_out(fill_f, fill_b)
    bubble = run.max_bubble()
    # each retry must shrink the largest bubble; the depth bound only keeps Python's stack
    if (run.max_approved < 0 or bubble < run.max_approved) and depth < _MAX_RETRIES:
        plan, retried = _try_v_schedule(p, m, limit, costs, fill_f, fill_b, run.bubble,
                                        depth + 1)
        if retried < bubble:
            return plan, retried
    return run.plan, bubble


class _Run:
    """The state of one `try_v_schedule` and its `put`."""

    def __init__(self, p: int, m: int, limit: int, costs: ZbvCosts,
                 approved: list[float] | None) -> None:
        self.p, self.m, self.limit, self.costs = p, m, limit, costs
        self.count = [[0] * 6 for _ in range(p)]  # per rank, cat * 2 + chunk
        self.end: dict[tuple[int, int, int, int], float] = {}  # (cat, chunk, rank, i)
        self.clock = [0.0] * p
        self.memory = [0] * p
        self.bubble = [0.0] * p
        self.pending_w: list[deque[int]] = [deque() for _ in range(p)]  # W chunks, in order
        self.plan: list[list[tuple[int, int, int]]] = [[] for _ in range(p)]
        self.approved = approved if approved is not None else [-1.0] * p
        self.max_approved = max(self.approved)
        self.last_id = (_W, 1, p - 1, m - 1)  # what the original reads at index -1

    # -- the costs of the op at hand ----------------------------------------------------------

    def cost(self, cat: int, chunk: int, rank: int) -> float:
        stage = _stage(self.p, rank, cat, chunk)
        return (self.costs.forward, self.costs.backward, self.costs.weight)[cat][stage]

    def comm(self, cat: int, chunk: int, rank: int) -> float:
        """The delay on the edge an F or B of `chunk` on `rank` receives over."""
        stage = _stage(self.p, rank, cat, chunk)
        edge = stage - 1 if cat == _F else stage  # F from the stage before, B from after
        return self.costs.delay[edge] if 0 <= edge < 2 * self.p - 1 else self.costs.comm

    def ended(self, key: tuple[int, int, int, int] | None) -> float:
        """End of an op, -1 if not put; None is the original's index -1 (its last op)."""
        return self.end.get(self.last_id if key is None else key, -1.0)

    def max_bubble(self, rank: int = -1) -> float:
        most = max(0.0, *self.bubble)
        if rank >= 0:
            most = max(most, self.max_approved - self.approved[rank])
        return most

    # -- put ----------------------------------------------------------------------------------

    def put(self, cat: int, chunk: int, rank: int) -> None:
        ready = no_bubble = self.clock[rank] + self.cost(cat, chunk, rank)
        i = self.count[rank][cat * 2 + chunk]
        f_mem_change = (1, 0, -1)[cat]
        if i >= self.m or self.memory[rank] + f_mem_change > self.limit:
            raise _Stop
        previous = cat * 2 + chunk - 1  # the original asserts this op of the rank was put
        before = (previous // 2, previous % 2, rank, i) if cat < _W else (_B, chunk, rank, i)
        if previous >= 0 and before not in self.end:
            raise _Stop
        neighbour = rank + 1 if chunk == 1 else rank - 1
        if cat < _W and 0 <= neighbour < self.p:
            key = (cat, chunk, neighbour, i)
            if key not in self.end:
                raise _Stop
            ready = max(ready, self.end[key] + self.comm(cat, chunk, rank)
                        + self.cost(cat, chunk, rank))
        if self.count[rank][0] > 0:
            self.bubble[rank] += ready - no_bubble
        self.end[cat, chunk, rank, i] = ready
        self.clock[rank] = ready
        self.memory[rank] += f_mem_change
        self.plan[rank].append((cat, chunk, i))
        if cat == _B:
            self.pending_w[rank].append(chunk)
        self.count[rank][cat * 2 + chunk] += 1

    def put_w(self, rank: int) -> None:
        if not self.pending_w[rank]:
            raise _Stop
        self.put(_W, self.pending_w[rank].popleft(), rank)

    def fill_with_w(self, rank: int, awaited: tuple[int, int, int, int] | None, c: float,
                    fill: bool) -> None:
        """Before an op that waits on `awaited`: W's while each fits before it arrives, then
        one more when the wait exceeds the approved bubble and `fill`."""
        pending = self.pending_w[rank]
        while pending and awaited is not None and \
                self.ended(awaited) + c >= self.clock[rank] + self.cost(_W, pending[0], rank):
            self.put_w(rank)
        if pending and self.ended(awaited) + c - self.clock[rank] > \
                self.max_bubble(rank) - self.bubble[rank] and fill:
            self.put_w(rank)

    # -- the rounds ---------------------------------------------------------------------------

    def lay_out(self, fill_f: bool, fill_b: bool) -> None:
        p, m, count = self.p, self.m, self.count
        # 1. warm-up: one down forward each; then, from the bottom, down forwards on ranks
        # 0..r while they fit before the first up forward arrives, then that up forward
        for r in range(p):
            self.put(_F, 0, r)
        for r in range(p - 1, -1, -1):
            if r < p - 1:
                arrives = self.ended((_F, 1, r + 1, 0)) + self.comm(_F, 1, r)
                while self.memory[r] + (2 + r * 2) <= self.limit and \
                        self.clock[r] + self.cost(_F, 0, r) <= arrives and count[r][0] < m:
                    for j in range(r + 1):
                        self.put(_F, 0, j)
            self.put(_F, 1, r)
        # 2. fill: forwards alternating chunks from the bottom until each rank has as many
        # in flight as the rank above it
        chunk = 0
        for r in range(1, p):
            while count[r][0] + count[r][1] < count[r - 1][0] + count[r - 1][1] or \
                    count[r][1] <= count[r - 1][1] < m:
                for j in range(p - 1, r - 1, -1):
                    if count[j][chunk] < m:
                        self.put(_F, chunk, j)
                chunk = 1 - chunk
        # 3. steady: 2m rounds of one backward, then one forward, on every rank
        for _ in range(2 * m):
            self.backward_round(fill_b)
            self.forward_round(fill_f)
        # 4. every W left
        for r in range(p):
            while self.pending_w[r]:
                self.put_w(r)

    def backward_round(self, fill_b: bool) -> None:
        p, m, count = self.p, self.m, self.count
        first, second = [], []  # B chunk 0 (up stage) ranks, B chunk 1 (down stage) ranks
        for r in range(p):
            if count[r][3] >= count[r][2]:
                first.append(r)
            elif r == p - 1 or (_B, 1, r + 1, count[r][3]) in self.end or count[r][2] >= m:
                second.append(r)
            else:
                first.append(r)
        for r, chunk in [(r, 1) for r in reversed(second)] + [(r, 0) for r in first]:
            awaited = None
            if chunk == 1 and r < p - 1:
                awaited = (_B, 1, r + 1, count[r][3])
            if chunk == 0 and r > 0:
                awaited = (_B, 0, r - 1, count[r][2])
            self.fill_with_w(r, awaited, self.comm(_B, chunk, r) if awaited else
                             self.costs.comm, chunk == 1 or fill_b)
            self.put(_B, chunk, r)

    def forward_round(self, fill_f: bool) -> None:
        p, m, count = self.p, self.m, self.count
        for r in range(p):
            if count[r][1] >= m:
                continue
            chunk: int | None = None
            if count[r][1] >= count[r][0]:
                chunk = 0
            elif r == p - 1 or (_F, 1, r + 1, count[r][1]) in self.end:
                chunk = 1
            elif count[r][0] < m and (r == 0 or (_F, 0, r - 1, count[r][0]) in self.end):
                chunk = 0
            if chunk is None:
                continue
            while self.memory[r] + 1 > self.limit:
                self.put_w(r)
            awaited = None
            if chunk == 0 and r > 0:
                awaited = (_F, 0, r - 1, count[r][0])
            if chunk == 1 and r < p - 1:
                awaited = (_F, 1, r + 1, count[r][1])
            self.fill_with_w(r, awaited, self.comm(_F, chunk, r) if awaited else
                             self.costs.comm, fill_f)
            self.put(_F, chunk, r)
