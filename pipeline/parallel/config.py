"""What the engine does beyond the pipeline itself: dp / cp / tp sizes, ZeRO stage, precision."""

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
    Rajbhandari et al., 2020). Model-state bytes per parameter with Adam in fp32 (K = 8 of
    moments; the paper's mixed-precision table is (2 + 2 + K)Ψ with K = 12):
    0: 4 + 4 + 8, 1: 4 + 4 + 8/d, 2: 4 + (4 + 8)/d, 3: (4 + 4 + 8)/d (+ 4 fp32 master / d:
    a unit's gathered parameters come and go, so its master is a copy)."""

    DISABLED = 0
    """Every replica holds the whole optimizer state."""
    OPTIMIZER_STATE = 1
    """ZeRO-1: optimizer state (and fp32 masters) sharded over dp; touched once per step."""
    GRADIENTS = 2
    """ZeRO-2: also the gradients: every backward's buckets are reduce-scattered into the
    rank's shard as they fill (m reductions a step instead of ZeRO-1's one; the reason
    DeepSpeed refuses ZeRO-2 under its pipeline), and never held whole after that."""
    PARAMETERS = 3
    """ZeRO-3: also the parameters: each layer is all-gathered before its forward and its
    backward and freed after use (`reshard_after_forward`)."""


def _zero_stage_problem(value: object) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or value not in tuple(ZeroStage):
        return (f"zero_stage must be a ZeroStage (DISABLED=0, OPTIMIZER_STATE=1, GRADIENTS=2, "
                f"PARAMETERS=3), got {value!r}")
    return None


def _sharded_stage_problem(config: ParallelConfig) -> str | None:
    """What ZeRO-2 / 3 do not run with yet (each refused up front, never a wrong answer)."""
    if config.zero_stage == ZeroStage.PARAMETERS and config.overlap_param_gather:
        return ("overlap_param_gather=True overlaps the all-gather after the step, which "
                "zero_stage=3 does not do (each layer gathers before its own forward); "
                "drop it")
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


def _half_parameters_problem(value: object, precision: object, zero_stage: object
                             ) -> str | None:
    if not isinstance(value, bool):
        return f"half_parameters must be True or False, got {value!r}"
    if not value:
        return None
    if precision not in ("bf16", "fp16"):
        return (f"half_parameters=True stores parameters in bf16 or fp16: set precision='bf16' "
                f"or 'fp16' (got {precision!r})")
    if zero_stage not in (ZeroStage.OPTIMIZER_STATE, ZeroStage.GRADIENTS,
                          ZeroStage.PARAMETERS):
        return ("half_parameters=True needs zero_stage=1, 2 or 3: without ZeRO its fp32 "
                "masters cost 18 (bf16) or 20 (fp16) bytes per parameter, while autocast "
                "over fp32 parameters (half_parameters=False) takes 16")
    return None


def _overlap_param_gather_problem(value: object, zero_stage: object) -> str | None:
    if not isinstance(value, bool):
        return f"overlap_param_gather must be True or False, got {value!r}"
    if value and zero_stage not in (ZeroStage.OPTIMIZER_STATE, ZeroStage.GRADIENTS,
                                    ZeroStage.PARAMETERS):
        return ("overlap_param_gather=True overlaps ZeRO's parameter all-gather: set "
                "zero_stage=1 or 2, or drop it (without ZeRO nothing is gathered)")
    return None


def _expert_parallel_problem(config: ParallelConfig) -> str | None:
    ep = config.expert_parallel
    problem = count_problem("expert_parallel", ep)
    if problem is not None or ep == 1:
        return problem
    dp, cp = config.data_parallel, config.context_parallel
    if dp is None or not isinstance(cp, int) or (dp * cp) % ep == 0:
        return None
    if cp == 1:
        return (f"expert_parallel={ep} must divide data_parallel={dp} (the experts are split "
                f"over dp replicas); choose among {[k for k in range(1, dp + 1) if dp % k == 0]}")
    replicas = dp * cp
    return (f"expert_parallel={ep} must divide data_parallel={dp} × context_parallel={cp} = "
            f"{replicas} (the experts are split over those ranks); choose among "
            f"{[k for k in range(1, replicas + 1) if replicas % k == 0]}")


def _expert_tensor_parallel_problem(config: ParallelConfig) -> str | None:
    value, tp = config.expert_tensor_parallel, config.tensor_parallel
    problem = count_problem("expert_tensor_parallel", value)
    if problem is not None or value in (1, tp):
        return problem
    return (f"expert_tensor_parallel={value} is not supported with tensor_parallel={tp}: "
            "each expert is either whole on its expert-parallel rank (1, Megatron-Core's "
            f"default) or split over the tp group ({tp}); use expert_tensor_parallel=1 or "
            f"{tp}")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the engine trains beyond the pipeline itself. Every field is checked here, once,
    on construction (all problems in one `PipelineConfigError`)."""

    data_parallel: int | None = None
    """Replicas (dp); each passes its own part of the batch. None: what the world size leaves
    after pipeline_parallel × context_parallel × tensor_parallel."""
    context_parallel: int = 1
    """Ranks splitting each sequence (cp): every cp rank of a replica passes the same batch
    and keeps 2 of its 2·cp sequence chunks; the layers must be context-parallel (e.g.
    `pipeline.interop.hf_context_parallel.context_parallel_hf`). Gradients are averaged over
    dp × cp."""
    tensor_parallel: int = 1
    """Ranks splitting each stage's tensors (tp); the model's layers must be tensor-parallel
    layers (e.g. `LayerSpec(ColumnParallelLinear, ...)`) to gain from it."""
    expert_parallel: int = 1
    """Ranks splitting each MoE layer's experts (ep), carved from dp × cp: ep consecutive
    ones exchange tokens by all-to-all (`pipeline.moe.expert_parallel`,
    `Topology.ep_group`); ep must divide data_parallel · context_parallel and every MoE
    layer's expert count. With tensor_parallel > 1 the ep groups are per tp rank: each tp
    rank dispatches its 1/t of the tokens (`pipeline.interop.hf_moe_tp`); with
    context_parallel > 1 each cp rank its own chunks of the sequence."""
    expert_tensor_parallel: int = 1
    """Ranks splitting each expert's weights (Megatron-Core's ``expert_tensor_parallel_size``).
    1: every expert is whole on its ep rank. tensor_parallel: each expert's gate / up
    projections column-split and down projection row-split over the tp group, the tp
    group's routed tokens gathered for them (`pipeline.moe.expert_tensor_parallel`); other
    values are refused."""
    zero_stage: ZeroStage = ZeroStage.DISABLED
    """`ZeroStage.OPTIMIZER_STATE` shards optimizer state over dp (ZeRO-1), `GRADIENTS` also
    the gradients (ZeRO-2), `PARAMETERS` also the parameters (ZeRO-3); the ints 0-3 are
    accepted and converted."""
    reshard_after_forward: bool = True
    """ZeRO-3: free each layer's gathered parameters after its forward and gather them again
    for its backward (less memory); False keeps them from the first forward until the step
    (torchtitan's `reshard_after_forward`: fewer gathers)."""
    prefetch_next_unit: bool = True
    """ZeRO-3: launch the next layer's gather before a layer's forward (the previous one's
    before its backward), so it overlaps the compute; False gathers each layer when it is
    needed (one layer gathered at a time, every gather exposed)."""
    precision: Precision = "fp32"
    """'bf16' or 'fp16': stages run under autocast, parameters and optimizer stay fp32
    (master weights). 'fp16' adds dynamic loss scaling with a rank-wide overflow vote."""
    half_parameters: bool = False
    """bf16 / fp16 with ZeRO: store the parameters in the half dtype and step fp32 master
    shards (Megatron's Float16Module + distributed optimizer). ZeRO-1 accumulates gradients
    into fp32 main-gradient buffers (fp16: fp16 ones): 6 + 12/d bytes per parameter with
    Adam in bf16, 4 + 16/d in fp16, instead of autocast's 8 + 8/d. ZeRO-2 / 3 keep the
    reduced gradient shard in the half dtype, as DeepSpeed does (its fp32 copy lives only
    through the step): 2 + 14/d and 14/d (DeepSpeed's 2 + 14/d and 16/d; ZeRO-3 gathers
    from the fp32 master, so no half shard of the parameters is kept). Without ZeRO
    autocast's 16 is already leaner than the 18 / 20 this would take, so it is refused."""
    overlap_grad_reduce: bool = True
    """Launch each gradient bucket's reduction (dp all-reduce, or ZeRO-1's reduce-scatter)
    from the gradient hooks of a stage's last backward as soon as the bucket is final (DDP,
    Megatron's `overlap_grad_reduce`), not after that backward at REDUCE_GRAD. ZeRO-2 / 3
    always launch from the hooks, in every backward."""
    overlap_param_gather: bool = False
    """ZeRO-1: leave each bucket's parameter all-gather after the step in flight and let the
    next step's forward of a layer wait only for the buckets holding its parameters
    (Megatron's `overlap_param_gather`), instead of gathering everything at STEP. Off by
    default, as in Megatron: between steps the parameters then hold the previous values on
    the pieces other ranks own until the next forward or `PipelineEngine.finish_param_gather`
    (the engine's checkpoints and forwards complete the gathers themselves; a caller reading
    `module.parameters()` directly must call it)."""
    broadcast_buffers: bool = True
    """dp > 1: at the start of every step (train and eval) copy dp rank 0's module buffers
    (BatchNorm's running statistics) to every replica, as DDP's ``broadcast_buffers`` does
    before each forward, so the replicas evaluate alike; False lets each replica keep the
    statistics of its own data. Once per step, not per microbatch: within a step each replica
    updates its buffers from its own microbatches (equal to DDP's for modules whose training
    forward does not read the buffers it updates, as BatchNorm's)."""
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
            count_problem("context_parallel", self.context_parallel),
            None if self.precision in get_args(Precision) else
            f"precision must be one of {get_args(Precision)}, got {self.precision!r}",
            _positive_number_problem("gradient_clipping", self.gradient_clipping,
                                     optional=True),
            _positive_number_problem("bucket_mb", self.bucket_mb,
                                     hint=f" (DDP's default is {DEFAULT_BUCKET_MB})"),
            _positive_number_problem("initial_loss_scale", self.initial_loss_scale),
            count_problem("loss_scale_window", self.loss_scale_window),
            _half_parameters_problem(self.half_parameters, self.precision, self.zero_stage),
            None if isinstance(self.overlap_grad_reduce, bool) else
            f"overlap_grad_reduce must be True or False, got {self.overlap_grad_reduce!r}",
            _overlap_param_gather_problem(self.overlap_param_gather, self.zero_stage),
            None if isinstance(self.broadcast_buffers, bool) else
            f"broadcast_buffers must be True or False, got {self.broadcast_buffers!r}",
            _expert_parallel_problem(self),
            _expert_tensor_parallel_problem(self),
            None if isinstance(self.reshard_after_forward, bool) else
            f"reshard_after_forward must be True or False, got {self.reshard_after_forward!r}",
            None if isinstance(self.prefetch_next_unit, bool) else
            f"prefetch_next_unit must be True or False, got {self.prefetch_next_unit!r}",
        ]
        zero = _zero_stage_problem(self.zero_stage) or _sharded_stage_problem(self)
        found = [problem for problem in (*problems, zero) if problem is not None]
        if found:
            raise (ZeroStageError if zero is not None else PipelineConfigError)(
                "; ".join(found))
        object.__setattr__(self, "zero_stage", ZeroStage(self.zero_stage))
