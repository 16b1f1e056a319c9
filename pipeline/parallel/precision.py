"""Mixed precision: autocast, fp32 master weights, a rank-wide loss scaler, global-norm clipping."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from pipeline.parallel.local_p2p import LocalLink
from pipeline.parallel.param_marks import is_tensor_parallel, is_tied_duplicate
from pipeline.parallel.small_reduce import small_all_reduce

__all__ = [
    "DynamicLossScaler",
    "Precision",
    "any_nonfinite",
    "autocast",
    "clip_coefficient",
    "clip_grad_norm_global",
    "counts_in_norm",
    "global_grad_norm",
    "half_dtype",
    "holds_nonfinite",
]

Precision = Literal["fp32", "bf16", "fp16"]

_AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: Precision, device_type: str = "cpu") -> AbstractContextManager[object]:
    """The context a stage's forward runs in: torch autocast for bf16/fp16, nothing for fp32.

    Parameters stay fp32 under autocast, so they *are* the fp32 master weights: matmuls run
    in the low precision, the optimizer updates fp32 values (Micikevicius et al., 2018).
    """
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision not in _AUTOCAST_DTYPES:
        raise ValueError(f"precision must be 'fp32', 'bf16' or 'fp16', got {precision!r}")
    return torch.autocast(device_type, dtype=_AUTOCAST_DTYPES[precision])


def half_dtype(precision: Precision) -> torch.dtype:
    """The dtype 'bf16' / 'fp16' names (parameters stored in it under `half_parameters`)."""
    if precision not in _AUTOCAST_DTYPES:
        raise ValueError(f"precision must be 'bf16' or 'fp16' here, got {precision!r}")
    return _AUTOCAST_DTYPES[precision]


def any_nonfinite(tensors: Iterable[torch.Tensor], group: ProcessGroup | None,
                  riders: torch.Tensor | None = None, link: LocalLink | None = None) -> bool:
    """Collective over `group`: True on every rank if any rank's tensors hold inf or NaN.

    `riders` (float64, CPU) are summed over `group` in the same message, in place: a value
    every rank needs at this point (the step's loss) costs no collective of its own. The
    vote goes through `link` when it spans `group` (`small_all_reduce`)."""
    extra = 0 if riders is None else riders.numel()
    values = torch.zeros(1 + extra, dtype=torch.float64)
    values[0] = float(holds_nonfinite(tensors))
    if riders is not None:
        values[1:] = riders.reshape(-1)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        small_all_reduce(values, group=group, link=link)  # the flag sums to the count
    if riders is not None:
        riders.copy_(values[1:].reshape(riders.shape))
    return bool(values[0].item() > 0)


def holds_nonfinite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether any of `tensors` holds inf or NaN (this rank only).

    Each tensor's minimum and maximum say it (NaN propagates into both, +inf is the maximum,
    -inf the minimum), from one pass that allocates nothing the tensor's size:
    ``torch.isfinite(t).all()`` builds three full-size temporaries (``t == t``, ``t.abs()``,
    ``!= inf``) and cost a tenth of DeepSpeed's AlexNet step here (benchmarks/
    bench_deepspeed_example.py)."""
    extremes = [value.float() for tensor in tensors if tensor.numel()
                for value in torch.aminmax(tensor.detach())]
    return bool(extremes) and not bool(torch.isfinite(torch.stack(extremes)).all())


def counts_in_norm(param: torch.Tensor, tp_rank: int) -> bool:
    """Whether this rank adds `param`'s gradient to the global norm.

    The rule (Megatron's `param_is_not_tensor_parallel_duplicate` and `param_is_not_shared`):
    every gradient element is counted exactly once over the group the norm is summed in, so
    - a tensor-parallel slice counts on every tp rank (each holds a different part);
    - a parameter replicated across tp (layer norm, row-parallel bias) counts on tp rank 0;
    - a tied weight counts on its primary owner only (its copies have equal gradients);
    - data-parallel replicas are excluded by the group: sum over the model-parallel group
      (pp × tp) for replicated gradients, over the world for ZeRO shards (disjoint already).
    """
    return (is_tensor_parallel(param) or tp_rank == 0) and not is_tied_duplicate(param)


_NORM_BLOCK = 1 << 16
"""Elements per fp32 partial norm in `_square_sum`."""


def _square_sum(grad: torch.Tensor) -> torch.Tensor:
    """The sum of squares of `grad` in fp32, in one pass and without a temporary of its size.

    ``grad.float().pow(2).sum()`` allocates the square (and an fp32 copy of a bf16 gradient)
    and took most of the non-compute time of DeepSpeed's AlexNet step here; one
    ``vector_norm`` per tensor, torch's ``clip_grad_norm_`` arithmetic, accumulates a 37M-element
    gradient with a relative error of 5e-3 on CPU. Norms of 64K-element blocks, squared and
    summed: 4e-7, at the speed of one ``vector_norm`` (a tensor of one block is exactly
    torch's)."""
    flat = grad.detach().reshape(-1)
    rows = flat.numel() // _NORM_BLOCK
    parts = []
    if rows:
        parts.append(torch.linalg.vector_norm(flat[:rows * _NORM_BLOCK].view(rows, _NORM_BLOCK),
                                              dim=1, dtype=torch.float32))
    if flat.numel() % _NORM_BLOCK:
        parts.append(torch.linalg.vector_norm(flat[rows * _NORM_BLOCK:],
                                              dtype=torch.float32).reshape(1))
    if not parts:
        return torch.zeros((), dtype=torch.float32, device=grad.device)
    return torch.cat(parts).pow(2).sum()


def global_grad_norm(grads: Iterable[torch.Tensor], group: ProcessGroup | None) -> torch.Tensor:
    """L2 norm of `grads` summed over every rank of `group` (fp32 accumulation)."""
    squares = [_square_sum(grad) for grad in grads]
    total = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float32)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total.sqrt()


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor `torch.nn.utils.clip_grad_norm_` multiplies gradients by (≤ 1)."""
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


def clip_grad_norm_global(params: Sequence[torch.nn.Parameter], max_norm: float,
                          group: ProcessGroup | None, *, tp_rank: int = 0) -> torch.Tensor:
    """Scale `params`' gradients so their norm over all ranks is at most `max_norm`.

    `group` is the model-parallel group (pp × tp) when gradients are data-parallel
    replicas (plain DP, after reduction); see `counts_in_norm` for what each rank counts.
    Returns the total norm before clipping, identical on every rank.
    """
    grads = [p.grad for p in params if p.grad is not None and counts_in_norm(p, tp_rank)]
    total = global_grad_norm(grads, group)
    coefficient = clip_coefficient(total, max_norm)
    for param in params:
        if param.grad is not None:
            param.grad.mul_(coefficient.to(param.grad.dtype))
    return total


class DynamicLossScaler:
    """fp16 loss scaling whose overflow verdict is shared by every rank in `group`.

    Each rank checks its own gradients for inf/NaN; a MAX all-reduce of the flags makes one
    verdict, so pipeline stages, data-parallel replicas and tensor-parallel shards all skip
    the same step (a rank stepping alone would desynchronise the replicas forever). On
    overflow the scale is multiplied by `backoff_factor`; after `growth_interval` clean steps
    by `growth_factor` (the schedule of `torch.amp.GradScaler` and Megatron's scaler).
    """

    def __init__(self, group: ProcessGroup | None, *, init_scale: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, min_scale: float = 1.0) -> None:
        problems = []
        if not (init_scale > 0 and math.isfinite(init_scale)):
            problems.append(f"init_scale must be finite and > 0, got {init_scale}")
        if not growth_factor > 1:
            problems.append(f"growth_factor must be > 1, got {growth_factor}")
        if not 0 < backoff_factor < 1:
            problems.append(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1:
            problems.append(f"growth_interval must be >= 1, got {growth_interval}")
        if problems:
            raise ValueError("; ".join(problems))
        self.group = group
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self.clean_steps = 0
        self.skipped_steps = 0

    def found_overflow(self, grads: Iterable[torch.Tensor]) -> bool:
        """Collective: True on every rank if any rank's gradients hold inf or NaN."""
        return any_nonfinite(grads, self.group)

    def unscale_(self, grads: Iterable[torch.Tensor]) -> None:
        inverse = 1.0 / self.scale
        for grad in grads:
            grad.mul_(inverse)

    def update(self, overflow: bool) -> None:
        """Adjust the scale after a step (skipped if `overflow`)."""
        if overflow:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= self.growth_factor

    def state_dict(self) -> dict[str, float]:
        """The scale and step counters (what a checkpoint keeps)."""
        return {"scale": self.scale, "clean_steps": float(self.clean_steps),
                "skipped_steps": float(self.skipped_steps)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore `state_dict()`; refuses a non-finite or non-positive scale."""
        scale = float(state["scale"])
        if not (scale > 0 and math.isfinite(scale)):
            raise ValueError(f"loss scale must be finite and > 0, got {scale}")
        self.scale = scale
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])

    def step(self, grads: Sequence[torch.Tensor], optimizer_step: Callable[[], None], *,
             overflow: bool | None = None) -> bool:
        """Vote on overflow (unless `overflow` gives the vote's answer, taken over the same
        group); if clean, unscale `grads` and run `optimizer_step`. Returns whether the step
        was taken (the same answer on every rank)."""
        if overflow is None:
            overflow = self.found_overflow(grads)
        if not overflow:
            self.unscale_(grads)
            optimizer_step()
        self.update(overflow)
        return not overflow
