"""DeepSpeed's pipeline gradient clipping, to reproduce a DeepSpeed run step for step.

DeepSpeed 0.19.8 clips a pipeline's fp32 gradients (no ZeRO, no fp16/bf16) with
``runtime/engine.py: clip_fp32_gradients`` -> ``runtime/utils.py: clip_grad_norm_(
module.parameters(), max_norm, mpu=grid)``, which adds a parameter's gradient to the norm
only ``if mpu.get_model_parallel_rank() == 0 or is_model_parallel_parameter(p)``. The pipe
grid's "model parallel" group (``runtime/pipe/topology.py: ds_model_proc_group``) is the
whole pipeline of one replica and its rank 0 is stage 0, so the norm is stage 0's gradients
only, and every stage scales by ``max_norm / (that norm + 1e-6)`` (capped at 1). Its
fp16, bf16 and ZeRO optimizers count every stage (they test the tensor-parallel rank), as
a single process does.

`clip_norm="global"` (the default) clips by the norm over every stage: what
``torch.nn.utils.clip_grad_norm_`` computes on the whole model in one process.
`clip_norm="first_stage"` clips as DeepSpeed's fp32 pipeline does.
"""

from __future__ import annotations

from typing import Literal

import torch

from pipeline.errors import PipelineConfigError
from pipeline.parallel.optimizer_step import ReplicatedGrads
from pipeline.parallel.precision import clip_coefficient, global_grad_norm
from pipeline.runtime.engine import PipelineEngine

__all__ = ["ClipNorm", "FirstStageNorm", "check_clip_norm", "use_clip_norm"]

ClipNorm = Literal["global", "first_stage"]
"""Which gradients the clipping norm counts: every stage's, or stage 0's (DeepSpeed)."""


class FirstStageNorm(ReplicatedGrads):
    """Replicated gradients clipped by the norm of stage 0's gradients alone (the norm is
    summed over the pipeline, where only stage 0's ranks contribute)."""

    def __init__(self, view: ReplicatedGrads, counts: bool) -> None:
        super().__init__(view.params, view.norm_group, view.tp_rank)
        self.counts = counts
        """Whether this rank holds stage 0 (its gradients make the norm)."""

    def clip(self, max_norm: float) -> torch.Tensor:
        counted = self.grads() if self.counts else []
        total = global_grad_norm(counted, self.norm_group)
        coefficient = clip_coefficient(total, max_norm)
        for grad in self.grads():
            grad.mul_(coefficient.to(grad.dtype))
        return total


def check_clip_norm(clip_norm: ClipNorm, *, zero_stage: int, precision: str) -> None:
    """Refuse a `clip_norm` this job cannot honour (before any engine is built)."""
    if clip_norm not in ("global", "first_stage"):
        raise PipelineConfigError(f"clip_norm must be 'global' or 'first_stage', got "
                                  f"{clip_norm!r}")
    if clip_norm == "first_stage" and (zero_stage or precision != "fp32"):
        raise PipelineConfigError(
            f"clip_norm='first_stage' reproduces DeepSpeed's fp32 pipeline clipping; with "
            f"zero_stage={zero_stage}, precision={precision!r} DeepSpeed's norm counts every "
            "stage, which is clip_norm='global' (the default)")


def use_clip_norm(engine: PipelineEngine, clip_norm: ClipNorm) -> None:
    """Make `engine` clip by `clip_norm`'s gradients (it counts every stage to begin with;
    `check_clip_norm` has passed)."""
    step = engine.training.step
    if clip_norm == "first_stage" and isinstance(step.view, ReplicatedGrads):
        step.view = FirstStageNorm(step.view, counts=0 in engine.stage_ids)
