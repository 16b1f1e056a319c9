"""Recomputation with a dial: none, selective (a layer's marked part), full layers, and partial
(only the first k layers of each stage).

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
section 4: full recomputation keeps only each layer's input (2sbh bytes at 16 bits) and redoes
its whole forward in the backward; selective recomputation drops only what is large and cheap
to redo, attention's core (softmax(QKᵀ)·V: the 5as²b term), and keeps the rest (34sbh).
A layer marks that part by calling `recompute_region`; the stage decides per layer whether
the mark is honoured. Partial recomputation applies either to the first k layers of each
stage only, so memory can be traded for time in steps of one layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from pipeline.errors import PipelineConfigError
from pipeline.recompute_region import ForwardOnce, recompute_region, selective_recompute

__all__ = ["ForwardOnce", "RecomputeMode", "RecomputePolicy", "recompute_region",
           "selective_recompute"]

RecomputeMode = Literal["none", "selective", "full"]
"""none: keep every activation; selective: recompute the regions layers mark
(`recompute_region`); full: keep each checkpoint segment's input, recompute the rest."""


@dataclass(frozen=True, kw_only=True)
class RecomputePolicy:
    """What one stage recomputes in its backward."""

    mode: RecomputeMode = "none"
    """See `RecomputeMode`."""
    layers: int | None = None
    """Partial recomputation: only the first `layers` layers of each stage (None: all)."""
    interval: int = 1
    """Full mode: layers per checkpoint segment (DeepSpeed's activation_checkpoint_interval);
    only the segment's input is kept."""

    def __post_init__(self) -> None:
        problems = []
        if self.mode not in get_args(RecomputeMode):
            problems.append(f"recompute must be one of {get_args(RecomputeMode)}, got "
                            f"{self.mode!r}")
        if self.layers is not None and (isinstance(self.layers, bool) or
                                        not isinstance(self.layers, int) or self.layers < 1):
            problems.append(f"recompute_layers must be an int >= 1 (the first layers of each "
                            f"stage to recompute) or None for all, got {self.layers!r}")
        elif self.layers is not None and self.mode == "none":
            problems.append(f"recompute_layers={self.layers} needs recompute='selective' or "
                            "'full' (it says how many layers of each stage recompute)")
        if isinstance(self.interval, bool) or not isinstance(self.interval, int) \
                or self.interval < 1:
            problems.append(f"the checkpoint interval must be an int >= 1, got "
                            f"{self.interval!r}")
        if problems:
            raise PipelineConfigError("; ".join(problems))

    @classmethod
    def of(cls, recompute: RecomputeMode, recompute_layers: int | None,
           activation_checkpoint_interval: int) -> RecomputePolicy:
        """The policy of `PipelineModule`'s three options: a checkpoint interval k > 0 alone
        is full recomputation in segments of k layers (DeepSpeed's meaning)."""
        interval = activation_checkpoint_interval
        if interval > 0 and recompute == "selective":
            raise PipelineConfigError(
                f"activation_checkpoint_interval={interval} recomputes whole layers and "
                "recompute='selective' only their marked parts; pass one of them")
        mode: RecomputeMode = "full" if interval > 0 and recompute == "none" else recompute
        return cls(mode=mode, layers=recompute_layers, interval=max(interval, 1))

    def recomputed(self, stage_layers: int) -> int:
        """How many of a stage's first layers the policy applies to."""
        if self.mode == "none":
            return 0
        return stage_layers if self.layers is None else min(self.layers, stage_layers)
