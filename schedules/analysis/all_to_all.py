"""The expert all-to-all of a mixture-of-experts stage: the costs the simulator and the planner share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ExpertAllToAll"]

PerStage = float | Sequence[float]


@dataclass(frozen=True, kw_only=True)
class ExpertAllToAll:
    """Seconds of expert-parallel all-to-all (token dispatch + combine, summed over the MoE
    layers of a stage) inside one microbatch's F and inside its B, a number for every stage or
    one per stage. A stage without MoE layers has 0."""

    forward: PerStage = 0.0
    """All-to-all time inside one F of a stage (dispatch + combine of its MoE layers)."""
    backward: PerStage = 0.0
    """All-to-all time inside one B (or I, when split) of a stage; W has none."""
