"""The handcrafted zero-bubble schedules ZB-H1 and ZB-H2 (Qi et al., ICLR 2024), one chunk per rank.

Qi, Wan, Huang, Lin, "Zero Bubble Pipeline Parallelism", ICLR 2024, https://arxiv.org/abs/2401.10241
§2 splits the backward into B (input gradient, on the critical path: the previous stage
waits for it) and W (weight gradient, needed only by the optimizer step). §3.1 then
builds two schedules by hand. Both are one rule with a parameter here, `extra`:
    ZB-H1 (extra = 1): 1F1B's warm-up; W postponed to fill the cool-down bubble.
    ZB-H2 (extra = 2): twice the warm-up forwards; W postponed twice as long.
Our text calls the paper's B "I" (input-gradient only); "B" is the fused backward.
"""

from __future__ import annotations

from schedules.ir.instructions import NONE, Instruction, Kind, instruction_from
from schedules.ir.schedule import Schedule, check_count, loop_placement

__all__ = ["zb_h1", "zb_h2"]

_F, _I, _W = Kind.F, Kind.I, Kind.W


def _op(kind: Kind, stage: int, microbatch: int) -> Instruction:
    return instruction_from((kind, stage, microbatch, NONE))


def zb_h1(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H1: 1F1B's activation memory (at most p microbatches on any rank), bubble
    (p-1)(F+B-W) instead of 1F1B's (p-1)(F+B+W) when W <= F and W <= B (paper §3.1, Fig. 3).

    Rank i warms up like 1F1B, then runs steady F, I, W triples but holds back its first
    i W passes; in the cool-down those held-back W's fill the gaps while the input
    gradients (I) run as soon as they arrive, which shortens the critical path from
    F+B+W to F+B per hop. Any m >= 1; the bubble formula needs m >= p.
    """
    return _handcrafted("zb-h1", num_ranks, num_microbatches, extra=1)


def zb_h2(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H2: about twice 1F1B's memory (at most 2p-1 microbatches per rank) for a bubble of
    (p-1)(F+B-2W), zero when F = B = W (paper §3.1, Fig. 3 bottom).

    Rank i runs 2(p-i-1) warm-up forwards, enough to keep it busy until its first input
    gradient returns, and holds back 2i W passes for the cool-down, which turns the
    schedule's parallelogram into a trapezoid with no idle time. Any m >= 1; the zero
    bubble needs m >= 2p-1.
    """
    return _handcrafted("zb-h2", num_ranks, num_microbatches, extra=2)


def _handcrafted(name: str, num_ranks: int, num_microbatches: int, *, extra: int) -> Schedule:
    # Legend: p ranks = stages (v = 1), m microbatches, rank i holds stage i.
    #   F forward, I input-gradient backward (the paper's B), W weight-gradient backward.
    #   extra: 1 for ZB-H1, 2 for ZB-H2.
    p = check_count("num_ranks", num_ranks)
    m = check_count("num_microbatches", num_microbatches)
    streams = []
    for i in range(p):
        # Warm-up: forwards until the first input gradient can have come back. With unit
        # costs it returns after 2(p-1-i) hops, so ZB-H2 fills all of them and ZB-H1 (1F1B's
        # memory) half of them.
        num_warmup = min(extra * (p - i - 1), m)
        # W passes rank i holds back: the later the rank, the longer the cool-down gap
        # it must fill while the last input gradients travel to rank 0.
        num_deferred_w = extra * i
        ops = [_op(_F, i, k) for k in range(num_warmup)]
        next_w = 0
        # Steady: F, I, then W once `num_deferred_w` W passes are held back.
        for k in range(m - num_warmup):
            ops.append(_op(_F, i, num_warmup + k))
            ops.append(_op(_I, i, k))
            if k >= num_deferred_w:
                ops.append(_op(_W, i, next_w))
                next_w += 1
        # Cool-down: each arriving I first; a W only while more than `num_deferred_w`
        # are pending, so the held-back ones remain to fill the final gaps.
        for k in range(m - num_warmup, m):
            ops.append(_op(_I, i, k))
            while k + 1 - next_w > num_deferred_w:
                ops.append(_op(_W, i, next_w))
                next_w += 1
        ops.extend(_op(_W, i, k) for k in range(next_w, m))
        streams.append(tuple(ops))
    return Schedule(name, m, loop_placement(p, 1), tuple(streams))
