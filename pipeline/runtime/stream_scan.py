"""What the interpreter reads off a stream before running it: pairs to interleave, last B."""

from __future__ import annotations

from collections.abc import Sequence

from schedules import Instruction, Kind

__all__ = ["interleavable_pairs", "last_backwards", "pair_spans"]

_BETWEEN = frozenset({Kind.SEND_F, Kind.SEND_B, Kind.RECV_F, Kind.RECV_B, Kind.LOAD})


def interleavable_pairs(stream: Sequence[Instruction]) -> dict[int, int]:
    """Step of each F -> step of the OVERLAP_B paired with it, where the two can start
    together at the F's step: only queueing ops lie between them (the lowering puts the F's
    send there), and none is the receive of the B's own output gradient (posted before the
    pair, or the pair runs as F then B)."""
    pairs: dict[int, int] = {}
    forward: int | None = None
    for k, op in enumerate(stream):
        if op.kind is Kind.F:
            forward = k
        elif op.kind is Kind.OVERLAP_B and forward is not None:
            own = (Kind.RECV_B, op.stage, op.microbatch)
            if all(stream[j][:3] != own for j in range(forward + 1, k)):
                pairs[forward] = k
            forward = None
        elif op.kind not in _BETWEEN:
            forward = None
    return pairs


def pair_spans(start: float, forward_end: float, end: float
               ) -> tuple[tuple[float, float], tuple[float, float]]:
    """The pair's F and OVERLAP_B spans in the trace: F from the pair's start until it ended,
    the B from there until the pair ends (the two tile the pair, as the simulator draws it)."""
    split = min(max(forward_end, start), end)
    return (start, split), (split, end)


def last_backwards(stream: Sequence[Instruction]) -> dict[int, int]:
    """Step index -> stage of each stage's last fused backward (B) before its REDUCE_GRAD.

    A stage whose last backward op is a split W is left out: its W runs layer by layer, so
    a weight shared by two layers would be accumulated after its bucket launched."""
    last: dict[int, tuple[int, Kind]] = {}
    found: dict[int, int] = {}
    for k, op in enumerate(stream):
        if op.kind in (Kind.B, Kind.OVERLAP_B, Kind.I, Kind.W):
            last[op.stage] = (k, op.kind)
        elif op.kind is Kind.REDUCE_GRAD and op.stage in last:
            index, kind = last[op.stage]
            if kind is not Kind.I and kind is not Kind.W:
                found[index] = op.stage
    return found
