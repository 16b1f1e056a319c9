"""V-Min and V-Half: V schedules built from a repeated building block (Qi et al., 2024).

Qi, Wan, Huang, Lin, "Pipeline Parallelism with Controllable Memory", NeurIPS 2024,
https://arxiv.org/abs/2405.15362. A schedule is one microbatch's ops on every rank (the
building block) repeated every 6 slots (F, I and W of two chunks per rank, unit costs);
a rank's peak memory is the sum over its ops of their lifespan / 6, so the block fixes it:
    V-Min  ~ 1/3 of 1F1B's activation memory, a small bubble that grows with p;
    V-Half ~ 1/2 of it, about zero bubble;
    V-ZB   = ZB-V (`zb_v`): 1F1B's memory, zero bubble.
Steps (§3-4 of the paper): place every microbatch's F and I by the block; put each W in
the next free slot after its I (oldest first); then squeeze: move warm-up and cool-down
ops to earlier free slots when that does not raise the rank's peak memory; the order per
rank is then run as early as the costs allow (`simulate`).
Legend: p ranks; on rank r, down stage r and up stage 2p-1-r; slot = unit time.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

import numpy as np

from schedules.ir.instructions import Instruction, Kind, stage_ops
from schedules.ir.schedule import Schedule, check_count, v_placement

__all__ = ["building_block", "v_half", "v_min"]

# Op types of one microbatch on one rank, in the block's dependency order.
_F_DOWN, _F_UP, _I_UP, _I_DOWN = range(4)
_PER_BLOCK = 6  # slots per microbatch per rank: F, I, W of two chunks
_KINDS = (Kind.F, Kind.F, Kind.I, Kind.I)  # of each op type


def building_block(p: int, variant: str) -> list[tuple[int, int, int, int]]:
    """Slots of F(down), F(up), I(up), I(down) of microbatch 0 on each rank.

    V-Min keeps every dependency one slot apart (the shortest lifespans), shifting the
    backward by 2 slots when p is a multiple of 3 so the four ops fall on distinct slots
    mod 6; V-Half spaces the forwards two slots apart, which halves 1F1B's memory and
    leaves the W's room to fill, shifting by 3 when p is even.
    """
    if variant == "min":
        shift = 2 if p % 3 == 0 else 0
        return [(r, 2 * p - 1 - r, 2 * p + shift + r, 4 * p + shift - 1 - r) for r in range(p)]
    if variant == "half":
        shift = 3 if p % 2 == 0 else 0
        return [(2 * r, 3 * p - 2 - r, 3 * p + shift + 2 * r - 1, 6 * p + shift - 2 - r)
                for r in range(p)]
    raise ValueError(f"unknown building block {variant!r}; use 'min' or 'half'")


def v_min(num_ranks: int, num_microbatches: int) -> Schedule:
    """V-Min: about a third of 1F1B's activation memory, at a small bubble."""
    return _from_block("v-min", num_ranks, num_microbatches, "min")


def v_half(num_ranks: int, num_microbatches: int) -> Schedule:
    """V-Half: about half of 1F1B's activation memory, about no bubble."""
    return _from_block("v-half", num_ranks, num_microbatches, "half")


def _from_block(name: str, num_ranks: int, num_microbatches: int, variant: str) -> Schedule:
    p = check_count("num_ranks", num_ranks)
    m = check_count("num_microbatches", num_microbatches)
    block = building_block(p, variant)
    # slots[r][(type, i)]: the slot of op `type` of microbatch i on rank r.
    slots = [{(t, i): block[r][t] + _PER_BLOCK * i for t in range(4) for i in range(m)}
             for r in range(p)]
    _squeeze(p, m, slots)
    streams = tuple(_stream(p, r, slots[r], m) for r in range(p))
    return Schedule(name, m, v_placement(p), streams)


def _occupancy(slots: dict[tuple[int, int], int]) -> np.ndarray:
    """Per slot, the type of the op in it (-1: free)."""
    where = np.fromiter(slots.values(), dtype=np.int64, count=len(slots))
    kinds = np.fromiter((t for t, _ in slots), dtype=np.int64, count=len(slots))
    occupied = np.full(int(where.max()) + 1, -1, dtype=np.int64)
    occupied[where] = kinds
    return occupied


class _Row:
    """One rank's slots and its peak memory's running sums, kept in step with every move
    `_move_if_fits` makes.

    Most chunk activations held, with each W in the next free slot after its I: the Ws form
    a queue served one per free slot, so by slot x (Lindley's recursion unrolled)
        idle(x) = max(0, max_{y <= x} gap(y)),  gap = S - A,
    free slots that found the queue empty (S counts free slots up to x, A the Is), and
        held(x) = Fw(x) - (S(x) - idle(x))
    forwards up to x (Fw) minus the Ws done by then. The peak is max(0, max_x held(x)).
    gap moves by at most one a slot, so idle rises by one at a time: it is kept as the
    sorted slots where it rises (`rises`; idle(x) = how many are <= x), which a move
    changes in a few places, and held as a list, which it changes over a window.
    """

    __slots__ = ("gap", "held", "limit", "occupied", "rises")

    def __init__(self, slots: dict[tuple[int, int], int]) -> None:
        occupied = _occupancy(slots)
        forward = (occupied == _F_DOWN) | (occupied == _F_UP)
        free = occupied < 0
        served = np.cumsum(free)
        gap = served - np.cumsum(~forward & ~free)
        idle = np.maximum(np.maximum.accumulate(gap), 0)
        held = np.cumsum(forward) - served + idle
        self.occupied: list[int] = occupied.tolist()
        self.gap: list[int] = gap.tolist()
        self.held: list[int] = held.tolist()
        self.rises: list[int] = np.flatnonzero(np.diff(idle, prepend=0)).tolist()
        # `_squeeze` keeps every row's peak at most the block's own
        self.limit = max(0, int(held.max()))


def _move_if_fits(row: _Row, t: int, earlier: int, slot: int) -> bool:
    """Move the op of type t in `slot` to the free slot `earlier` unless that raises the
    row's peak above its limit; True if it moved.

    Only [earlier, slot) changes: there Fw - S rises by `rise` (the op's forward, one free
    slot fewer) and gap falls by `fall` (one free slot fewer, its I earlier); `_squeeze`
    moves ops in slot order, so gap from `slot` on, all that is read of it, is still the
    block's. Before `earlier` nothing changes; from `slot` on idle can only fall, so held
    too. In the window, with `before` = idle(earlier - 1): up to the first slot q where idle
    exceeds before + fall, the new idle is `before`; from q on, the gap there sets it, idle
    - fall, and held moves by rise - fall.
    """
    forward = t in (_F_DOWN, _F_UP)
    rise, fall = (2, 1) if forward else (1, 2)
    held, rises, limit = row.held, row.rises, row.limit
    before = bisect_right(rises, earlier - 1)
    q = min(rises[before + fall], slot) if before + fall < len(rises) else slot
    if q > earlier:  # held = Fw - S + idle, with the new Fw - S and idle = `before`
        first = [held[x] - bisect_right(rises, x) + rise + before for x in range(earlier, q)]
        if max(first) > limit:
            return False
    # from q on held moves by +1 for a forward; by -1 for an I, which cannot pass the limit
    if forward and q < slot and max(held[q:slot]) + 1 > limit:
        return False
    row.occupied[earlier], row.occupied[slot] = t, -1
    if q > earlier:
        held[earlier:q] = first
    if q < slot:
        shift = rise - fall
        held[q:slot] = [x + shift for x in held[q:slot]]
    removed = bisect_left(rises, q) - before  # idle's rises in [earlier, q): now flat there
    if removed:
        del rises[before:before + removed]
        _settle(row, slot, removed)
    return True


def _settle(row: _Row, slot: int, removed: int) -> None:
    """From `slot` on, after a move took `removed` of idle's rises before it: idle rises
    again where the gap first reaches each level it lost (in order: gap moves by at most
    one a slot), and held falls by the levels still missing."""
    rises, held, gap = row.rises, row.held, row.gap
    at = bisect_left(rises, slot)  # = idle(slot - 1) now
    x, end = slot, len(gap)
    for found in range(removed):
        start, level = x, at + found + 1
        while x < end and gap[x] < level:
            x += 1
        held[start:x] = [h - (removed - found) for h in held[start:x]]
        if x == end:
            break
        rises.insert(at + found, x)


def _squeeze(p: int, m: int, slots: list[dict[tuple[int, int], int]]) -> None:
    """The paper's reordering: in time order, move each warm-up and cool-down op to the
    earliest free slot after its dependencies on its rank, unless that raises the rank's
    peak memory. The steady phase (from rank 0's first down-stage I to its last forward)
    is left alone: the block leaves it no free slot."""
    rows = [_Row(mine) for mine in slots]  # kept in step with `slots`
    steady_from, steady_to = slots[0][_I_DOWN, 0], slots[0][_F_DOWN, m - 1]
    for slot, r, t, i in sorted((slot, r, t, i) for r, mine in enumerate(slots)
                                for (t, i), slot in mine.items()):
        if steady_from <= slot <= steady_to:
            continue
        row, mine = rows[r], slots[r]
        # after what the op waits for: its previous microbatch, the same microbatch's
        # previous op on this rank, and the V's previous stage (rank r-1 on the way down,
        # r+1 on the way up)
        ready = mine[t, i - 1] + 1 if i else 0
        if t:
            ready = max(ready, mine[t - 1, i] + 1)
        if t == _F_DOWN or t == _I_UP:
            if r:
                ready = max(ready, slots[r - 1][t, i] + 1)
        elif r < p - 1:
            ready = max(ready, slots[r + 1][t, i] + 1)
        occupied = row.occupied
        for earlier in range(ready, slot):
            if occupied[earlier] < 0 and _move_if_fits(row, t, earlier, slot):
                mine[t, i] = earlier
                break


def _stream(p: int, r: int, slots: dict[tuple[int, int], int], m: int) -> tuple[
        Instruction, ...]:
    """Rank r's ops in slot order, each W in the next free slot after its I (oldest first).

    A free slot runs the oldest waiting W unless none waits, the slots where idle rises
    (`_Row`); the Ws without a free slot follow at the end. Placed by sorting, not slot by
    slot: most slots hold an op. `slots` is in `_from_block`'s order, (type, microbatch)
    for type 0..3, microbatch 0..m-1.
    """
    down, up = r, 2 * p - 1 - r
    stage = (down, up, up, down)  # of each op type
    ops = [op for kind, s in zip(_KINDS, stage) for op in stage_ops(kind, s, m)[:m]]
    where = np.fromiter(slots.values(), dtype=np.int64, count=4 * m)
    occupied = np.full(int(where.max()) + 1, -1, dtype=np.int64)
    occupied[where] = np.repeat(np.arange(4), m)
    free = occupied < 0
    idle = np.maximum(np.maximum.accumulate(np.cumsum(free) - np.cumsum(occupied >= _I_UP)), 0)
    serving = np.flatnonzero(free & (np.diff(idle, prepend=0) == 0))[:2 * m]
    # the Ws in the order of their Is' slots
    weights = [*stage_ops(Kind.W, up, m)[:m], *stage_ops(Kind.W, down, m)[:m]]
    by_input = np.argsort(where[2 * m:])
    ops += map(weights.__getitem__, by_input.tolist())
    after = np.arange(len(occupied), len(occupied) + 2 * m - len(serving))
    order = np.argsort(np.concatenate([where, serving, after]))
    return tuple(map(ops.__getitem__, order.tolist()))
