"""ZB-V (Qi et al., ICLR 2024, §6): two chunks per rank in a V, zero bubble at 1F1B's memory."""

from __future__ import annotations

from schedules.ir.schedule import Schedule, check_count, v_placement
from tests.support.reference_generators.steps import StepTable, emit_steps

__all__ = ["zb_v"]


def zb_v(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-V: rank r holds stages r (chunk 0) and 2p-1-r (chunk 1), so the first and the last
    stage share rank 0 and a microbatch goes down the ranks and back up (a V).

    With F = B = W per chunk the bubble is zero once m >= 2p-1, and every rank holds at
    most 2p chunk activations, i.e. p microbatches of a whole rank's share of the model:
    1F1B's peak on rank 0, on every rank (paper §6, Fig. 8). Any m >= 1: for m < 2p-1 the
    table runs for 2p-1 microbatches and the extra ones are dropped (still valid, with
    bubbles).
    """
    p = check_count("num_ranks", num_ranks)
    m = check_count("num_microbatches", num_microbatches)
    n = max(m, 2 * p - 1)  # microbatches the table is laid out for
    streams = tuple(emit_steps((r, 2 * p - 1 - r), _steps(p, n, r), m) for r in range(p))
    return Schedule("zb-v", m, v_placement(p), streams)


def _steps(p: int, n: int, r: int) -> StepTable:
    # Legend: p ranks, n microbatches (>= 2p-1), rank r; chunk 0 = stage r (down the V),
    # chunk 1 = stage 2p-1-r (up the V). F forward, I input-gradient backward (the paper's
    # B), W weight-gradient backward; in unit time (F = I = W per chunk):
    return [
        # Warm-up 1: chunk-0 forwards until microbatch 0 has come down to rank p-1 and
        # back up to this rank's chunk 1: 2(p-r)-1 slots.
        (2 * (p - r) - 1, "F0"),
        # Warm-up 2: chunk-1 forwards start arriving from below; alternate them with more
        # chunk-0 forwards (r pairs).
        (r, "F1 F0"),
        # Warm-up 3: the input gradient of chunk 1 needs no wait at the V's bottom, so each
        # chunk-1 forward is followed by its backward at once (p-r triples).
        (p - r, "F1 I1 W1"),
        # Steady: one microbatch through both chunks per 6 slots, W right after its I.
        (n - 2 * p + r + 1, "F0 I0 W0 F1 I1 W1"),
        (p - r - 1, "I0 W0 F1 I1 W1"),  # chunk-0 forwards are all done
        # Cool-down: input gradients first (they are on the critical path to rank 0),
        # then the weight gradients held back fill what is left.
        (r, "I0 I1"),
        (p - r, "I0 W0"),
        (r, "W1"),
        (r, "W0"),
    ]
