"""DualPipeV: DeepSeek-V3's DualPipe cut in half, two chunks per rank in a V placement."""

from __future__ import annotations

from collections import deque
from itertools import compress, repeat
from operator import and_, getitem, is_, itemgetter, ne

from schedules.ir.errors import ScheduleConfigError
from schedules.ir.instructions import Instruction, Kind, stage_ops
from schedules.ir.schedule import Schedule, check_count, v_placement
from schedules.ir.steps import StepTable, emit_steps

__all__ = ["dualpipev"]


def dualpipev(num_ranks: int, num_microbatches: int, *, overlap: bool = False) -> Schedule:
    """DualPipeV (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, §3.2.1,
    https://arxiv.org/abs/2412.19437; the "V" variant of https://github.com/deepseek-ai/DualPipe).

    Rank r holds stages r and 2p-1-r. In the main phase each rank pairs the forward of
    one microbatch with the backward of another (``F0 B1 F1 B0``), which DeepSeek overlap
    to hide communication. With `overlap` every such F directly followed by a fused B is
    an overlapped pair (F, OVERLAP_B: torch's OVERLAP_F_B), costed by `CostModel.overlap`;
    without, they run back to back. Backwards are fused except where the split fills a
    bubble (warm-up step 3 and the second half of the cool-down).
    Requires m >= 2p, like DualPipe and torch's `ScheduleDualPipeV`.
    """
    p = check_count("num_ranks", num_ranks)
    m = check_count("num_microbatches", num_microbatches)
    if m < 2 * p:
        raise ScheduleConfigError(
            f"dualpipev needs num_microbatches >= 2 × num_ranks = {2 * p}, got {m}: rank 0 "
            f"runs 2p-1 = {2 * p - 1} chunk-0 forwards before its first main step (DualPipe "
            f"asserts the same); use m >= {2 * p}, or 'zb-v', which takes any m")
    streams = tuple(emit_steps((r, 2 * p - 1 - r), _steps(p, m, r), m) for r in range(p))
    if overlap:
        # DualPipe leaves the V's bottom rank's first main-step F0 B1 unpaired: the two
        # are on one rank back to back, and overlapping them would only delay the B.
        streams = tuple(_pair_up(stream, (r, 2 * p - 1 - r), m, skip_first=r == p - 1)
                        for r, stream in enumerate(streams))
    return Schedule("dualpipev-overlap" if overlap else "dualpipev", m, v_placement(p), streams)


def _pair_up(stream: tuple[Instruction, ...], stages: tuple[int, ...], m: int, *,
             skip_first: bool) -> tuple[Instruction, ...]:
    """Each B that directly follows an F (of another microbatch) becomes OVERLAP_B, except
    the first such B when `skip_first`. `stages`: the rank's, m: the microbatches."""
    overlapped = {stage: stage_ops(Kind.OVERLAP_B, stage, m) for stage in stages}
    # the positions k of a B right after an F of another microbatch, and their pairs, by C
    # iterators: no Python step per op (~10^5 pairs a search at scale)
    kinds = list(map(itemgetter(0), stream))
    microbatches = list(map(itemgetter(2), stream))
    b_after_f = map(and_, map(is_, kinds[1:], repeat(Kind.B)),
                    map(is_, kinds[:-1], repeat(Kind.F)))
    paired = map(and_, b_after_f, map(ne, microbatches[1:], microbatches[:-1]))
    where = list(compress(range(1, len(stream)), paired))[1 if skip_first else 0:]
    stage_at = map(itemgetter(1), map(stream.__getitem__, where))
    pairs = map(getitem, map(overlapped.__getitem__, stage_at),
                map(microbatches.__getitem__, where))
    out = list(stream)
    deque(map(out.__setitem__, where, pairs), maxlen=0)  # out[k] = its pair, for each k
    return tuple(out)


def _steps(p: int, m: int, r: int) -> StepTable:
    # Legend: p ranks, m microbatches, rank r; chunk 0 = stage r, chunk 1 = stage 2p-1-r.
    # F forward, B fused backward, I input-gradient backward, W the oldest queued weight
    # gradient (DualPipe's weight queue). Steps follow DualPipe's numbering.
    switch = (r + 1) // 2  # step-6 iteration from which the backward is split
    step6_switch = "I1 I0" if r % 2 else "B1 I0"  # odd ranks split one op earlier
    return [
        (2 * (p - r - 1), "F0"),  # Step 1: nF0
        (r + 1, "F0 F1"),  # Step 2: nF0F1
        (p - r - 1, "I1 W F1"),  # Step 3: nB1W1F1, zero-bubble split
        (m - 2 * p + r + 1, "F0 B1 F1 B0"),  # Step 4 (main step): nF0B1F1B0
        (p - r - 1, "B1 F1 B0"),  # Step 5: nB1F1B0
        (switch, "B1 B0"),  # Step 6: nB1B0, first half fused ...
        (1, step6_switch),
        (r - switch, "I1 I0"),  # ... second half split
        (p - r - 1, "W I0"),  # Step 7: nWB0, each W fills the wait for the next gradient
        (r + 1, "W"),  # Step 8: nW
    ]
