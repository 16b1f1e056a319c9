"""What the engine does beyond the pipeline itself: dp / tp sizes, ZeRO stage, precision."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum
from typing import get_args

from pipeline.errors import PipelineConfigError
from pipeline.parallel.data_parallel import DEFAULT_BUCKET_MB
from pipeline.parallel.precision import Precision
from schedules.ir.schedule import count_problem

__all__ = ["ParallelConfig", "ZeroStage", "ZeroStageError"]


class ZeroStageError(PipelineConfigError):
    """A ZeRO stage that does not exist, or that cannot run together with pipeline parallelism."""


class ZeroStage(IntEnum):
    """How much of the training state is sharded over the data-parallel group (ZeRO,
    Rajbhandari et al., 2020). Only DISABLED and OPTIMIZER_STATE run with a pipeline."""

    DISABLED = 0
    """Every replica holds the whole optimizer state."""
    OPTIMIZER_STATE = 1
    """ZeRO-1: optimizer state (and fp32 masters) sharded over dp; touched once per step."""
    GRADIENTS = 2
    """ZeRO-2: refused. It shards gradients and reduce-scatters after every backward, while a
    pipeline accumulates gradients over all m microbatches before one step (m reductions
    instead of one; DeepSpeed refuses the combination for the same reason)."""
    PARAMETERS = 3
    """ZeRO-3: refused, as ZeRO-2, and it would also re-gather parameters per microbatch."""


_REFUSED = (ZeroStage.GRADIENTS, ZeroStage.PARAMETERS)


def _zero_stage_problem(value: object) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or value not in tuple(ZeroStage):
        return (f"zero_stage must be a ZeroStage (DISABLED=0, OPTIMIZER_STATE=1), got "
                f"{value!r}")
    if value in _REFUSED:
        stage = ZeroStage(value)
        return (f"zero_stage={int(stage)} ({stage.name}) cannot be combined with pipeline "
                f"parallelism: ZeRO-{int(stage)} shards gradients"
                f"{' and parameters' if stage is ZeroStage.PARAMETERS else ''} and would "
                f"reduce-scatter after every microbatch's backward, while a pipeline "
                f"accumulates gradients over all m microbatches before one step (the reason "
                f"DeepSpeed refuses it too). Use zero_stage=1 (ZeroStage.OPTIMIZER_STATE: "
                f"optimizer state sharded over data_parallel) or 0")
    return None


def _positive_number_problem(name: str, value: object, *, optional: bool = False,
                             hint: str = "") -> str | None:
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and value > 0):
        none = " or None" if optional else ""
        return f"{name} must be a finite number > 0{none}, got {value!r}{hint}"
    return None


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the engine trains beyond the pipeline itself. Every field is checked here, once,
    on construction (all problems in one `PipelineConfigError`)."""

    data_parallel: int | None = None
    """Replicas (dp); each passes its own part of the batch. None: what the world size leaves
    after pipeline_parallel × tensor_parallel."""
    tensor_parallel: int = 1
    """Ranks splitting each stage's tensors (tp); the model's layers must be tensor-parallel
    layers (e.g. `LayerSpec(ColumnParallelLinear, ...)`) to gain from it."""
    zero_stage: ZeroStage = ZeroStage.DISABLED
    """`ZeroStage.OPTIMIZER_STATE` shards optimizer state over dp (ZeRO-1); the ints 0 and 1
    are accepted and converted."""
    precision: Precision = "fp32"
    """'bf16' or 'fp16': stages run under autocast, parameters and optimizer stay fp32
    (master weights). 'fp16' adds dynamic loss scaling with a rank-wide overflow vote."""
    gradient_clipping: float | None = None
    """Clip gradients to this global norm over every rank (None: no clipping)."""
    bucket_mb: float = DEFAULT_BUCKET_MB
    """Size of one gradient reduction bucket, in MiB."""
    initial_loss_scale: float = 2.0**16
    """fp16: the first loss scale."""
    loss_scale_window: int = 1000
    """fp16: clean steps before the loss scale doubles."""

    def __post_init__(self) -> None:
        problems = [
            None if self.data_parallel is None else count_problem("data_parallel",
                                                                  self.data_parallel),
            count_problem("tensor_parallel", self.tensor_parallel),
            None if self.precision in get_args(Precision) else
            f"precision must be one of {get_args(Precision)}, got {self.precision!r}",
            _positive_number_problem("gradient_clipping", self.gradient_clipping,
                                     optional=True),
            _positive_number_problem("bucket_mb", self.bucket_mb,
                                     hint=f" (DDP's default is {DEFAULT_BUCKET_MB})"),
            _positive_number_problem("initial_loss_scale", self.initial_loss_scale),
            count_problem("loss_scale_window", self.loss_scale_window),
        ]
        zero = _zero_stage_problem(self.zero_stage)
        found = [problem for problem in (*problems, zero) if problem is not None]
        if found:
            raise (ZeroStageError if zero is not None else PipelineConfigError)(
                "; ".join(found))
        object.__setattr__(self, "zero_stage", ZeroStage(self.zero_stage))
