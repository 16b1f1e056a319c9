"""The `fuse_backward` pass: turn split backwards (I then W) back into one fused B."""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from typing import Literal

from schedules.ir.errors import ScheduleConfigError
from schedules.ir.instructions import COMPUTE_KINDS, NONE, Instruction, Kind
from schedules.ir.schedule import Schedule

__all__ = ["fuse_backward"]

FuseWhere = Literal["adjacent", "all"]


def fuse_backward(schedule: Schedule, *, where: FuseWhere = "adjacent",
                  wanted: Callable[[Instruction], bool] | None = None) -> Schedule:
    """Replace I(s,i) by B(s,i) and drop W(s,i), for the pairs chosen by `where`:

    - "adjacent": W(s,i) is the next compute op after I(s,i) on the rank (communication in
      between is allowed), so nothing ran between them and the split bought nothing; this is
      torch's `_merge_bw`, and a fused backward saves keeping the inputs of W alive.
    - "all": every I, wherever its W is; the W's work moves forward to the I's slot.

    `wanted(I op)` narrows the choice further (e.g. one stage only). The result runs
    wherever the input ran: the fused B produces the same gradient at the same point, W
    feeds no other op, and the order of communication ops is unchanged, so a lowered
    schedule keeps its deadlock-freedom.
    """
    if where not in ("adjacent", "all"):
        raise ScheduleConfigError(f"fuse_backward where={where!r}: use 'adjacent' or 'all'")
    streams = tuple(_fuse_stream(stream, where, wanted) for stream in schedule.streams)
    return schedule.replace_streams(streams)


def _fuse_stream(stream: tuple[Instruction, ...], where: FuseWhere,
                 wanted: Callable[[Instruction], bool] | None) -> tuple[Instruction, ...]:
    fused: set[tuple[int, int]] = set()  # (stage, microbatch) whose I became B
    compute_positions = [k for k, op in enumerate(stream) if op.kind in COMPUTE_KINDS]
    next_compute = dict(pairwise(compute_positions))
    for k in compute_positions:
        kind, s, i, _ = stream[k]
        if kind is not Kind.I or (wanted is not None and not wanted(stream[k])):
            continue
        if where == "all":
            fused.add((s, i))
        elif k in next_compute:
            follower = stream[next_compute[k]]
            if follower.kind is Kind.W and (follower.stage, follower.microbatch) == (s, i):
                fused.add((s, i))
    out = []
    for op in stream:
        key = (op.stage, op.microbatch)
        if key in fused:
            if op.kind is Kind.I:
                op = Instruction(Kind.B, op.stage, op.microbatch, NONE)
            elif op.kind is Kind.W:
                continue
        out.append(op)
    return tuple(out)
