"""Compute-only schedule generators: GPipe, 1F1B, interleaved 1F1B and forward-only.

Legend used throughout: p pipeline ranks, v chunks (virtual stages) per rank, S = p·v
stages, m microbatches; F forward, B full backward. Generators take integers and return a
`Schedule` whose streams hold only compute; `schedules.passes.lowering` adds the rest.
"""

from __future__ import annotations

from schedules.ir.instructions import NONE, Instruction, Kind, instruction_from
from schedules.ir.schedule import Schedule, check_count, loop_placement

__all__ = ["forward_only", "gpipe", "interleaved_1f1b", "interleaved_order", "one_f_one_b"]

_F, _B = Kind.F, Kind.B


def _op(kind: Kind, stage: int, microbatch: int) -> Instruction:
    return instruction_from((kind, stage, microbatch, NONE))


def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """GPipe (Huang et al. 2019): every forward, then every backward.

    Every rank holds all m microbatches' activations at the turn (peak m).
    """
    p = check_count("num_ranks", num_ranks)
    m = check_count("num_microbatches", num_microbatches)
    streams = tuple(
        tuple(_op(_F, r, i) for i in range(m)) + tuple(_op(_B, r, i) for i in range(m))
        for r in range(p)
    )
    return Schedule("gpipe", m, loop_placement(p, 1), streams)


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """1F1B, PipeDream-Flush (Narayanan et al. 2021).

    Rank r runs `num_warmup_microbatches = min(p - r - 1, m)` forwards (warm-up), then
    alternates one forward and one backward (steady 1F1B), then drains the remaining
    backwards (cool-down). Rank r never holds more than min(p - r, m) activations.
    m < p is allowed: the warm-up is simply shorter.
    """
    p = check_count("num_ranks", num_ranks)
    m = check_count("num_microbatches", num_microbatches)
    streams = []
    for r in range(p):
        num_warmup_microbatches = min(p - r - 1, m)
        num_steady = m - num_warmup_microbatches
        ops = [_op(_F, r, i) for i in range(num_warmup_microbatches)]
        for k in range(num_steady):
            ops.append(_op(_F, r, num_warmup_microbatches + k))
            ops.append(_op(_B, r, k))
        ops.extend(_op(_B, r, i) for i in range(num_steady, m))
        streams.append(tuple(ops))
    return Schedule("1f1b", m, loop_placement(p, 1), tuple(streams))


def _group_sizes(p: int, m: int) -> list[int]:
    """Split m microbatches into groups of at least p (one group of m when m < p).

    m // p groups, sizes as even as possible, larger groups first. With m a multiple of p
    every group has exactly p microbatches (Megatron's grouping). A short group after a
    full one is what makes Megatron's order unrunnable for m mod p ∉ {0} ∪ [p, ∞), so
    the remainder is spread over the groups instead; checked exhaustively for p ≤ 16,
    m ≤ 64, v ≤ 4 (putting the larger groups last fails in 1,362 of those 4,096 cases).
    """
    if m <= p:
        return [m]
    num_groups = m // p
    base, extra = divmod(m, num_groups)
    return [base + 1] * extra + [base] * (num_groups - extra)


def _virtual_order(v: int, sizes: list[int], *, backward: bool) -> list[tuple[int, int]]:
    """(chunk, microbatch) pairs in Megatron's order: for each group of microbatches, chunk 0
    for the whole group, then chunk 1, ...; backward visits the chunks in reverse."""
    chunks = range(v - 1, -1, -1) if backward else range(v)
    order: list[tuple[int, int]] = []
    first = 0
    for size in sizes:
        order.extend((c, i) for c in chunks for i in range(first, first + size))
        first += size
    return order


def interleaved_1f1b(num_ranks: int, num_microbatches: int, chunks: int = 2) -> Schedule:
    """Interleaved 1F1B with virtual stages (Narayanan et al. 2021, Megatron-LM).

    Stage s = c·p + r lives on rank r (loop placement). Microbatches go in groups of
    N ≥ p (see `_group_sizes`); rank r warms up with
    `num_warmup = min((p - r - 1)·2 + (v - 1)·N, v·m)` forwards, runs steady 1F1B over
    (chunk, microbatch) pairs, then drains backwards. With m a multiple of p and chunk
    costs 1/v of a stage, the bubble is (p-1)/(v·m) of the ideal time, v times smaller
    than 1F1B's.

    Any m >= 1 is allowed. Megatron requires m mod N ∈ {0} ∪ [p, ∞) for its group size N,
    and torch requires m divisible by max(1, m // p): both keep groups of a fixed size.
    Here groups may differ in size by one, larger first, which keeps the order runnable
    for every m (the property tests validate p ≤ 16, m ≤ 64, v ≤ 4); the lowering then
    places communication from that order, so no further condition is needed.
    """
    p = check_count("num_ranks", num_ranks)
    m = check_count("num_microbatches", num_microbatches)
    v = check_count("chunks", chunks)
    streams = interleaved_order(p, m, v, warmup_hops=2)
    return Schedule("interleaved", m, loop_placement(p, v), streams)


def interleaved_order(p: int, m: int, v: int, *, warmup_hops: int) -> tuple[
        tuple[Instruction, ...], ...]:
    """Megatron's interleaved streams with `num_warmup = min(warmup_hops·(p - r - 1) +
    (v - 1)·N, v·m)` on rank r: 2 hops is interleaved 1F1B (a forward out and its gradient
    back), 1 hop torch's interleaved zero bubble, which holds fewer activations and lets
    the split W's fill the rest."""
    sizes = _group_sizes(p, m)
    forward_order = _virtual_order(v, sizes, backward=False)
    backward_order = _virtual_order(v, sizes, backward=True)
    total = v * m
    make = instruction_from  # `_op` inlined: ~10^6 ops a search at scale
    streams = []
    for r in range(p):
        num_warmup = min((p - r - 1) * warmup_hops + (v - 1) * sizes[0], total)
        num_steady = total - num_warmup
        ops = [make((_F, c * p + r, i, NONE)) for c, i in forward_order[:num_warmup]]
        emit = ops.append
        for k in range(num_steady):
            c, i = forward_order[num_warmup + k]
            emit(make((_F, c * p + r, i, NONE)))
            c, i = backward_order[k]
            emit(make((_B, c * p + r, i, NONE)))
        ops.extend(make((_B, c * p + r, i, NONE)) for c, i in backward_order[num_steady:])
        streams.append(tuple(ops))
    return tuple(streams)


def forward_only(num_ranks: int, num_microbatches: int, chunks: int = 1) -> Schedule:
    """Inference: every rank runs the forwards of its stages, no backward, no step."""
    p = check_count("num_ranks", num_ranks)
    m = check_count("num_microbatches", num_microbatches)
    v = check_count("chunks", chunks)
    order = _virtual_order(v, [m], backward=False)
    streams = tuple(tuple(_op(_F, c * p + r, i) for c, i in order) for r in range(p))
    return Schedule("forward-only", m, loop_placement(p, v), streams)

