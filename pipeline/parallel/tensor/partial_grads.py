"""Tensor-parallel-partial gradients: marked by their tp hook, summed over tp once a step.

A parameter replicated over the t tensor-parallel ranks but used on 1/t of the tokens (a
norm under sequence parallelism, a MoE router or whole expert at tp × ep) gets a partial
gradient on each tp rank. `sequence.sum_gradient_over_tensor_parallel` sums it with a tensor
hook in every backward (exact for any use of the module, engine or not) and marks the
parameter here: its tp group, the hook and its handle. An engine whose reducer sees the whole
accumulated gradient before the data-parallel reduction (ZeRO-0 / 1, or no dp) takes the sum
over instead (`PartialGradSums`): the hooks are removed and the accumulated gradients are
summed over tp in place, coalesced (one flat all-reduce per group and dtype per call),
Megatron-Core's `finalize_model_grads` once a step instead of once per microbatch. Summing is
linear, so the step's gradient is the same.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.hooks import RemovableHandle

from pipeline.parallel.data_parallel import grad_or_zeros

__all__ = ["PartialGradSums", "keep_hooks", "mark_partial_gradient", "partial_gradient_group"]

_GROUP = "pipesched_tp_partial_group"
_HOOK = "pipesched_tp_partial_hook"
_HANDLE = "pipesched_tp_partial_handle"
_DEFERRED = "pipesched_tp_partial_deferred"

GradLocator = Callable[[nn.Parameter], torch.Tensor]
"""The tensor holding a parameter's accumulated gradient (written in place by the sum)."""
GradHook = Callable[[torch.Tensor], torch.Tensor]


def mark_partial_gradient(param: torch.Tensor, group: ProcessGroup | None,
                          hook: GradHook) -> None:
    """Record that `param`'s gradient is partial over `group`, and sum it with the tensor
    hook `hook` every backward, unless an engine sums it once a step (`PartialGradSums`)."""
    setattr(param, _GROUP, group)
    setattr(param, _HOOK, hook)
    setattr(param, _HANDLE, None if getattr(param, _DEFERRED, False)
            else param.register_hook(hook))


def partial_gradient_group(param: torch.Tensor) -> tuple[bool, ProcessGroup | None]:
    """(whether `param` is marked, its tp group)."""
    return hasattr(param, _GROUP), getattr(param, _GROUP, None)


def keep_hooks(params: Sequence[torch.Tensor]) -> None:
    """`params`' tp sums run in their hooks again (an engine that cannot defer them, on a
    module an earlier engine deferred)."""
    for param in params:
        if getattr(param, _DEFERRED, False):
            delattr(param, _DEFERRED)
            if hasattr(param, _HOOK) and getattr(param, _HANDLE, None) is None:
                setattr(param, _HANDLE, param.register_hook(getattr(param, _HOOK)))


class PartialGradSums:
    """A rank's stage parameters whose tp sums it takes over, summed on request.

    Every parameter given (`params_by_stage`, less `keep`) is deferred: marked now, its
    hook is removed; marked later (a module that registers in its first forward), it gets
    none. `sum(params)` all-reduces, over their tp groups, the accumulated gradients of the
    marked ones among `params` not summed yet this step (one flat all-reduce per group and
    dtype, in the order the groups first appear: every tp rank issues the same calls);
    `sum_stage` / `sum_all` the rest; `new_step` after the step's reduction. `locate` finds
    a gradient (``.grad`` by default; `GradBuffer.main_grad` when a buffer holds it).
    `calls` and `payload_bytes` count the all-reduces issued."""

    def __init__(self, params_by_stage: Mapping[int, Sequence[nn.Parameter]], *,
                 keep: Sequence[nn.Parameter] = ()) -> None:
        kept = {id(p) for p in keep}
        keep_hooks(list(keep))
        self.by_stage = {stage: [p for p in params if p.requires_grad and id(p) not in kept]
                         for stage, params in params_by_stage.items()}
        self._deferred = {id(p) for params in self.by_stage.values() for p in params}
        self._locators: dict[int, GradLocator] = {}
        self._done: set[int] = set()
        self.calls = 0
        self.payload_bytes = 0

    def take_over(self) -> None:
        """Defer every parameter given: remove the hooks of the marked ones."""
        for stage_params in self.by_stage.values():
            for param in stage_params:
                setattr(param, _DEFERRED, True)
                handle: RemovableHandle | None = getattr(param, _HANDLE, None)
                if handle is not None:
                    handle.remove()
                    setattr(param, _HANDLE, None)

    def locate_with(self, params: Sequence[nn.Parameter], locate: GradLocator) -> None:
        """Read (and sum into) `params`' gradients through `locate`."""
        for param in params:
            if id(param) in self._deferred:
                self._locators[id(param)] = locate

    def sum(self, params: Sequence[Any]) -> None:
        """Sum over tp the marked parameters among `params` not summed yet this step."""
        batches: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        groups: dict[int, ProcessGroup | None] = {}
        for param in params:
            if id(param) not in self._deferred or id(param) in self._done \
                    or not hasattr(param, _GROUP):
                continue
            self._done.add(id(param))
            grad = self._locators.get(id(param), grad_or_zeros)(param)
            group = getattr(param, _GROUP)
            groups[id(group)] = group
            batches.setdefault((id(group), grad.dtype), []).append(grad)
        for (group_id, _), grads in batches.items():
            flat = torch.cat([grad.reshape(-1) for grad in grads])
            dist.all_reduce(flat, group=groups[group_id])
            self.calls += 1
            self.payload_bytes += flat.numel() * flat.element_size()
            offset = 0
            with torch.no_grad():
                for grad in grads:
                    grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                    offset += grad.numel()

    def sum_stage(self, stage: int) -> None:
        """Sum whatever of `stage`'s marked parameters is not summed yet."""
        self.sum(self.by_stage.get(stage, ()))

    def sum_all(self) -> None:
        """Sum every marked parameter not summed yet (stages in order)."""
        for stage in sorted(self.by_stage):
            self.sum_stage(stage)

    def new_step(self) -> None:
        """The step's sums are done: every marked parameter is pending again."""
        self._done.clear()
