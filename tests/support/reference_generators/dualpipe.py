"""DualPipeV: DeepSeek-V3's DualPipe cut in half, two chunks per rank in a V placement."""

from __future__ import annotations

from schedules.ir.errors import ScheduleConfigError
from schedules.ir.instructions import Instruction, Kind
from schedules.ir.schedule import Schedule, check_count, v_placement
from tests.support.reference_generators.steps import StepTable, emit_steps

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
        streams = tuple(_pair_up(stream, skip_first=r == p - 1)
                        for r, stream in enumerate(streams))
    return Schedule("dualpipev-overlap" if overlap else "dualpipev", m, v_placement(p), streams)


def _pair_up(stream: tuple[Instruction, ...], *, skip_first: bool) -> tuple[Instruction, ...]:
    """Each B that directly follows an F (of another microbatch) becomes OVERLAP_B, except
    the first such B when `skip_first`."""
    out = list(stream)
    for k in range(1, len(out)):
        before, op = out[k - 1], out[k]
        if op.kind is Kind.B and before.kind is Kind.F and before.microbatch != op.microbatch:
            if skip_first:
                skip_first = False
                continue
            out[k] = Instruction(Kind.OVERLAP_B, op.stage, op.microbatch)
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
