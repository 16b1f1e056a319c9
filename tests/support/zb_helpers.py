"""Shared measures for the zero-bubble tests: the paper's iteration cost, activations per stage."""

from __future__ import annotations

from schedules import Timeline

__all__ = ["iteration_cost"]


def iteration_cost(timeline: Timeline) -> float:
    """The Zero Bubble paper's cost: the longest rank span (first op start to last op end).

    Its bubble formulas, e.g. ZB-H1's (p-1)(F+B-W), are this minus m(F+B+W). A rank's share
    of the model is one stage (v = 1) or v chunks; activations in these tests are counted
    per (stage, microbatch) as `figures()` does, so with the two chunks of a V schedule,
    2 chunk activations make one stage activation (each chunk is half a rank's share).
    """
    cost = 0.0
    for rank in range(timeline.num_ranks):
        mask = timeline.rank == rank
        if mask.any():
            cost = max(cost, float(timeline.end[mask].max() - timeline.start[mask].min()))
    return cost
