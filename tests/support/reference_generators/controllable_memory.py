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

from collections import deque

import numpy as np

from schedules.ir.instructions import NONE, Instruction, Kind, instruction_from
from schedules.ir.schedule import Schedule, check_count, v_placement

__all__ = ["building_block", "v_half", "v_min"]

# Op types of one microbatch on one rank, in the block's dependency order.
_F_DOWN, _F_UP, _I_UP, _I_DOWN = range(4)
_PER_BLOCK = 6  # slots per microbatch per rank: F, I, W of two chunks


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
    streams = tuple(_stream(p, r, slots[r]) for r in range(p))
    return Schedule(name, m, v_placement(p), streams)


def _dependencies(p: int, r: int, t: int, i: int) -> list[tuple[int, int, int]]:
    """(rank, type, microbatch) the op waits for: the V's previous stage, the same
    microbatch's previous op on this rank, and the op's previous microbatch."""
    deps = []
    if t in (_F_DOWN, _I_UP) and r > 0:
        deps.append((r - 1, t, i))
    if t in (_F_UP, _I_DOWN) and r < p - 1:
        deps.append((r + 1, t, i))
    if t > 0:
        deps.append((r, t - 1, i))
    if i > 0:
        deps.append((r, t, i - 1))
    return deps


def _peak(slots: dict[tuple[int, int], int]) -> int:
    """Most chunk activations held, with each W in the next free slot after its I."""
    return _occupancy_peak(_occupancy(slots))


def _occupancy(slots: dict[tuple[int, int], int]) -> np.ndarray:
    """Per slot, the type of the op in it (-1: free)."""
    where = np.fromiter(slots.values(), dtype=np.int64, count=len(slots))
    kinds = np.fromiter((t for t, _ in slots), dtype=np.int64, count=len(slots))
    occupied = np.full(int(where.max()) + 1, -1, dtype=np.int64)
    occupied[where] = kinds
    return occupied


def _occupancy_peak(occupied: np.ndarray) -> int:
    """`_peak` of a rank's slots as `_occupancy` gives them. The Ws form a queue served one
    per free slot: by slot x, D(x) = S(x) + min(0, min_{y <= x} (A(y) - S(y))) of them ran
    (Lindley's recursion unrolled), A counting the Is and S the free slots up to there;
    held = forwards - D, largest at a forward. Vectorised: `_squeeze` asks it of every move
    it tries."""
    forward = (occupied == _F_DOWN) | (occupied == _F_UP)
    free = occupied < 0
    arrived = np.cumsum(~forward & ~free)
    served = np.cumsum(free)
    done = served + np.minimum(np.minimum.accumulate(arrived - served), 0)
    return max(0, int((np.cumsum(forward) - done).max()))


def _squeeze(p: int, m: int, slots: list[dict[tuple[int, int], int]]) -> None:
    """The paper's reordering: in time order, move each warm-up and cool-down op to the
    earliest free slot after its dependencies on its rank, unless that raises the rank's
    peak memory. The steady phase (from rank 0's first down-stage I to its last forward)
    is left alone: the block leaves it no free slot."""
    occupancy = [_occupancy(mine) for mine in slots]  # kept in step with `slots`
    limits = [_occupancy_peak(row) for row in occupancy]
    steady_from, steady_to = slots[0][_I_DOWN, 0], slots[0][_F_DOWN, m - 1]
    for slot, r, t, i in sorted((slot, r, t, i) for r, mine in enumerate(slots)
                                for (t, i), slot in mine.items()):
        if steady_from <= slot <= steady_to:
            continue
        mine, row = slots[r], occupancy[r]
        ready = 1 + max((slots[q][u, j] for q, u, j in _dependencies(p, r, t, i)), default=-1)
        for earlier in range(ready, slot):
            if row[earlier] >= 0:
                continue
            row[earlier], row[slot] = t, -1
            if _occupancy_peak(row) <= limits[r]:
                mine[t, i] = earlier
                break
            row[earlier], row[slot] = -1, t


def _stream(p: int, r: int, slots: dict[tuple[int, int], int]) -> tuple[Instruction, ...]:
    """Rank r's ops in slot order, each W in the next free slot after its I (oldest first)."""
    stage = {_F_DOWN: r, _F_UP: 2 * p - 1 - r, _I_UP: 2 * p - 1 - r, _I_DOWN: r}
    by_slot = {slot: key for key, slot in slots.items()}
    out: list[Instruction] = []
    pending: deque[tuple[int, int]] = deque()
    for slot in range(max(by_slot) + 1):
        if slot not in by_slot:
            if pending:
                out.append(instruction_from((Kind.W, *pending.popleft(), NONE)))
            continue
        t, i = by_slot[slot]
        kind = Kind.F if t in (_F_DOWN, _F_UP) else Kind.I
        out.append(instruction_from((kind, stage[t], i, NONE)))
        if kind is Kind.I:
            pending.append((stage[t], i))
    out.extend(instruction_from((Kind.W, s, i, NONE)) for s, i in pending)
    return tuple(out)
