"""The Zero Bubble authors' greedy for ZB-V under real costs (Qi et al., ICLR 2024, §6 and App.).

Rank r holds the down stage d = r and the up stage u = 2p-1-r (V placement). The paper's
V scheduler works in rounds against simulated time:
    1. warm-up: forwards of d on ranks 0..r until the first up-forward can arrive at r,
       as far as memory allows, then the first up-forward of every rank, from the bottom;
    2. fill: more forwards, alternating down and up, until every rank has as many in
       flight as the rank above it;
    3. steady, 2m rounds: each rank puts one backward (I) and then one forward, and fills
       a wait with a W when the W fits before the awaited input arrives, or when the wait
       exceeds the bubble the other ranks already have ("approved" bubble);
    4. every W left.
The whole is repeated with each rank's bubble as its new allowance while the largest
bubble shrinks, for each of the 4 settings of "fill waits before I / before F". Memory
counts chunk activations: +1 at F, -1 at W (the paper's f_mem, w_mem; I frees none).
Written from the paper and its public scheduler; used by `zb_v_auto` as one candidate
family and by the benchmark as the reference to beat. Two departures: where the public
scheduler stops on an assertion (a fill or steady-round op whose input is not put yet, or
a fill forward without memory), this one lets the op wait for a later round; and it
returns None, not an error, when the rounds still cannot be laid out under the memory
limit (e.g. a limit of p on uneven costs).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from schedules.ir.instructions import NONE, Instruction, Kind, instruction_from

__all__ = ["V_GREEDY_GRID", "VGreedyKnobs", "v_greedy_order"]

_F, _I, _W = Kind.F, Kind.I, Kind.W
_UNKNOWN = -1.0


class _Infeasible(Exception):
    """The rounds ran out of order (e.g. memory too small for the warm-up): no candidate."""


@dataclass(frozen=True)
class VGreedyKnobs:
    """The two fill settings the paper's V scheduler tries."""

    fill_before_backward: bool = True
    fill_before_forward: bool = True
    extra_warmup: int = 0
    """Warm-up rounds of down forwards past the time rule, per rank, still within memory
    and m - r (the authors' scheduler: 0)."""

    def label(self) -> str:
        extra = f", warmup{self.extra_warmup:+d}" if self.extra_warmup else ""
        return (f"v-greedy(fill_i={int(self.fill_before_backward)}, "
                f"fill_f={int(self.fill_before_forward)}{extra})")


V_GREEDY_GRID: tuple[VGreedyKnobs, ...] = tuple(
    VGreedyKnobs(fill_i, fill_f, extra)
    for extra, fill_i, fill_f in itertools.product((0, 1, 2), (True, False), (True, False)))
"""The settings `zb_v_auto` tries: the authors' four fill settings, each with 0, 1 and 2
warm-up rounds past the time rule (uneven costs: the rule can stop a round too early)."""


def v_greedy_order(num_ranks: int, num_microbatches: int, memory_limit: int,
                   forward: Sequence[float], backward: Sequence[float],
                   weight: Sequence[float], delay: Sequence[float],
                   knobs: VGreedyKnobs = VGreedyKnobs()) -> tuple[
        tuple[Instruction, ...], ...] | None:
    """The V greedy's per-rank streams for 2p stages, or None when its rounds cannot be laid
    out under `memory_limit` (chunk activations per rank) for this p and m."""
    best: _Attempt | None = None
    allowance: list[float] | None = None
    for _ in range(64):  # each retry must shrink the largest bubble; this bounds the chain
        try:
            attempt = _Attempt(num_ranks, num_microbatches, memory_limit, forward, backward,
                               weight, delay, knobs, allowance)
            attempt.run()
        except _Infeasible:
            break
        if best is not None and attempt.max_bubble() >= best.max_bubble():
            break
        best = attempt
        allowance = list(attempt.bubble)
    return None if best is None else tuple(tuple(s) for s in best.streams)


@dataclass
class _Attempt:
    # Legend: p ranks; on rank r, down stage d(r) = r and up stage u(r) = 2p-1-r; m
    # microbatches. Forward order per rank: F(d), F(u). Backward: I(u) then I(d).
    p: int
    m: int
    limit: int
    forward: Sequence[float]
    backward: Sequence[float]
    weight: Sequence[float]
    delay: Sequence[float]
    knobs: VGreedyKnobs
    allowance: list[float] | None
    f_end: dict[tuple[int, int], float] = field(default_factory=dict)
    i_end: dict[tuple[int, int], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        p = self.p
        self.clock = [0.0] * p
        self.memory = [0] * p
        self.bubble = [0.0] * p
        self.started = [False] * p
        self.count_f = [[0, 0] for _ in range(p)]  # per rank: [down, up] forwards put
        self.count_i = [[0, 0] for _ in range(p)]  # per rank: [up, down] input grads put
        self.pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(p)]
        self.streams: list[list[Instruction]] = [[] for _ in range(p)]

    def stage(self, r: int, side: int) -> int:
        """Side 0: the down stage r; side 1: the up stage 2p-1-r."""
        return r if side == 0 else 2 * self.p - 1 - r

    def max_bubble(self, r: int = -1) -> float:
        worst = max(self.bubble)
        if r >= 0 and self.allowance is not None:
            worst = max(worst, max(self.allowance) - self.allowance[r])
        return worst

    # Arrival of the cross-rank input an op waits for (_UNKNOWN: not put yet; None: none).
    def forward_input(self, r: int, side: int) -> float | None:
        s, i = self.stage(r, side), self.count_f[r][side]
        if s == 0 or (side == 1 and r == self.p - 1):
            return None  # stage 0, or the V's bottom (its input is on the same rank)
        end = self.f_end.get((s - 1, i), _UNKNOWN)
        return end + self.delay[s - 1] if end >= 0.0 else _UNKNOWN

    def backward_input(self, r: int, side: int) -> float | None:
        # side 0 here is the first backward (the up stage), side 1 the down stage.
        s = self.stage(r, 1 - side)
        i = self.count_i[r][side]
        if s == 2 * self.p - 1 or (side == 1 and r == self.p - 1):
            return None
        end = self.i_end.get((s + 1, i), _UNKNOWN)
        return end + self.delay[s] if end >= 0.0 else _UNKNOWN

    def put(self, r: int, kind: Kind, side: int) -> None:
        if kind is _W:
            if not self.pending_w[r]:
                raise _Infeasible
            s, i = self.pending_w[r].popleft()
            self._advance(r, self.clock[r], self.weight[s])
            self.memory[r] -= 1
        elif kind is _F:
            s, i = self.stage(r, side), self.count_f[r][side]
            arrival = self.forward_input(r, side)
            if i >= self.m or arrival == _UNKNOWN or self.memory[r] + 1 > self.limit:
                raise _Infeasible
            if side == 1 and self.count_f[r][0] <= i:
                raise _Infeasible  # the up forward needs this rank's down forward first
            self.f_end[s, i] = self._advance(r, max(self.clock[r], arrival or 0.0),
                                             self.forward[s])
            self.count_f[r][side] += 1
            self.memory[r] += 1
            self.started[r] = True
        else:
            s, i = self.stage(r, 1 - side), self.count_i[r][side]
            arrival = self.backward_input(r, side)
            own = self.f_end.get((s, i), _UNKNOWN)
            if i >= self.m or arrival == _UNKNOWN or own < 0.0 or (
                    side == 1 and self.count_i[r][0] <= i):
                raise _Infeasible
            self.i_end[s, i] = self._advance(r, max(self.clock[r], arrival or 0.0),
                                             self.backward[s])
            self.count_i[r][side] += 1
            self.pending_w[r].append((s, i))
        self.streams[r].append(instruction_from((kind, s, i, NONE)))

    def _advance(self, r: int, start: float, cost: float) -> float:
        """Run an op from `start` (>= the rank's clock); idle after the first F is bubble."""
        if self.started[r]:
            self.bubble[r] += start - self.clock[r]
        self.clock[r] = start + cost
        return self.clock[r]

    def fill(self, r: int, arrival: float | None, allowed: bool) -> None:
        """W's that fit before `arrival`, then one more if the wait is above the allowance."""
        if arrival is None or arrival < 0.0:
            return
        while self.pending_w[r] and arrival >= self.clock[r] + self.weight[
                self.pending_w[r][0][0]]:
            self.put(r, _W, 0)
        if allowed and self.pending_w[r] and \
                arrival - self.clock[r] > self.max_bubble(r) - self.bubble[r]:
            self.put(r, _W, 0)

    def run(self) -> None:
        p, m = self.p, self.m
        # Step 1: warm-up.
        for r in range(p):
            self.put(r, _F, 0)
        for r in range(p - 1, -1, -1):
            if r < p - 1:
                target = self.f_end[(self.stage(r + 1, 1), 0)] + self.delay[self.stage(r, 1) - 1]
                extra = self.knobs.extra_warmup
                while (self.memory[r] + 2 + 2 * r <= self.limit
                       and self.count_f[r][0] < m - r):
                    if self.clock[r] + self.forward[r] > target:
                        if extra <= 0:
                            break
                        extra -= 1  # a round beyond the time rule
                    for j in range(r + 1):
                        self.put(j, _F, 0)
            self.put(r, _F, 1)
        # Step 2: fill until each rank has as many forwards as the rank above it.
        side, idle_turns = 0, 0
        for r in range(1, p):
            while (sum(self.count_f[r]) < sum(self.count_f[r - 1])
                   or self.count_f[r][1] <= self.count_f[r - 1][1] < m):
                before = sum(map(sum, self.count_f))
                for j in range(p - 1, r - 1, -1):
                    # (the public scheduler asserts here; uneven costs can leave a rank
                    # without the input or the memory: it waits for the steady rounds)
                    if self.count_f[j][side] < m and self.memory[j] < self.limit and \
                            self.forward_input(j, side) != _UNKNOWN:
                        self.put(j, _F, side)
                side = 1 - side
                idle_turns = idle_turns + 1 if sum(map(sum, self.count_f)) == before else 0
                if idle_turns > 1:
                    raise _Infeasible  # neither side can add a forward: the fill is stuck
        # Step 3: steady rounds, one backward then one forward per rank: 2m rounds when
        # every input is there in time; an op whose input is not put yet waits a round.
        placed = -1
        while placed != (placed := sum(map(len, self.streams))):
            self._backward_round()
            self._forward_round()
        # Step 4: the rest of the W's.
        for r in range(p):
            while self.pending_w[r]:
                self.put(r, _W, 0)
        if any(len(stream) != 6 * m for stream in self.streams):
            raise _Infeasible  # the rounds left some op unplaced

    def _backward_round(self) -> None:
        p, m = self.p, self.m
        up_first, down = [], []  # side 0: the up stage's I; side 1: the down stage's I
        for r in range(p):
            up_done, down_done = self.count_i[r]
            if down_done >= up_done:
                up_first.append(r)
            elif r == p - 1 or up_done >= m or self.i_end.get(
                    (self.stage(r, 0) + 1, down_done), _UNKNOWN) >= 0.0:
                down.append(r)
            else:
                up_first.append(r)
        for r, side in [(r, 1) for r in reversed(down)] + [(r, 0) for r in up_first]:
            i = self.count_i[r][side]
            if i >= m or self.backward_input(r, side) == _UNKNOWN or \
                    (self.stage(r, 1 - side), i) not in self.f_end:
                continue  # its inputs are not put yet: a later round puts this backward
            allowed = side == 1 or self.knobs.fill_before_backward
            self.fill(r, self.backward_input(r, side), allowed)
            self.put(r, _I, side)

    def _forward_round(self) -> None:
        p, m = self.p, self.m
        for r in range(p):
            down_done, up_done = self.count_f[r]
            if up_done >= m:
                continue
            side: int | None = None
            if up_done >= down_done:
                side = 0
            elif r == p - 1 or self.f_end.get((self.stage(r, 1) - 1, up_done), _UNKNOWN) >= 0:
                side = 1
            elif down_done < m and (r == 0 or self.f_end.get((r - 1, down_done), _UNKNOWN) >= 0):
                side = 0
            if side is None or (side == 0 and down_done >= m) or \
                    self.forward_input(r, side) == _UNKNOWN:
                continue  # its input is not put yet: a later round puts this forward
            while self.memory[r] + 1 > self.limit:
                self.put(r, _W, 0)
            self.fill(r, self.forward_input(r, side), self.knobs.fill_before_forward)
            self.put(r, _F, side)
