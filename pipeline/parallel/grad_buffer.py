"""Gradient buckets launched as they become final, and the main-gradient buffer they fill.

Megatron's `main_grad` (Shoeybi et al., 2019; its distributed optimizer): a parameter's
gradient is added into its slice of one contiguous buffer as soon as autograd has
accumulated it, and the parameter's own `.grad` is dropped, so at the optimizer step a
gradient exists once, in the buffer's dtype (fp32 main gradients for bf16 parameters).

Overlap (DDP's buckets, Megatron's `overlap_grad_reduce`): during a stage's *last* backward
of the step (`arm`), each parameter whose gradient arrives is final; a bucket whose every
parameter is final is handed to `launch` right away, inside the backward. Buckets launch
strictly in their fixed order, so every data-parallel replica issues the same collectives in
the same order whatever its data (a parameter without a gradient in that backward holds its
bucket, and the later ones, back until `flush`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["BucketLaunches", "GradBuffer"]


class BucketLaunches:
    """Which buckets are final during a last backward; launches them strictly in order.

    `members[b]` lists the parameter indices bucket b waits for. While armed, `final(k)` marks
    parameter k's gradient final and hands every bucket now complete, in index order, to
    `launch(b)`; `flush` launches the rest (parameters without a gradient in that backward).
    """

    def __init__(self, members: Sequence[Sequence[int]], num_params: int,
                 launch: Callable[[int], None]) -> None:
        self._launch = launch
        self._buckets_of: list[list[int]] = [[] for _ in range(num_params)]
        for b, indices in enumerate(members):
            for k in indices:
                self._buckets_of[k].append(b)
        self._needs = [len(indices) for indices in members]
        self._waiting = list(self._needs)
        self._final = [False] * num_params
        self.armed = False
        self.launched = 0
        """Buckets handed to `launch` this step (they go in index order)."""

    def arm(self) -> None:
        """The next backward is the last of the step: launch buckets as they complete."""
        self.armed = True

    def final(self, k: int) -> None:
        """Parameter k's gradient arrived in the armed backward: it is final."""
        if self._final[k]:
            # a second accumulation inside the last backward (a parameter used by two
            # layers of a split W pass): its bucket may be on the wire already
            raise RuntimeError(f"parameter {k} of a gradient region accumulated twice in its "
                               f"last backward; set overlap_grad_reduce=False for this model")
        self._final[k] = True
        for b in self._buckets_of[k]:
            self._waiting[b] -= 1
        while self.launched < len(self._needs) and self._waiting[self.launched] == 0:
            self.launched += 1
            self._launch(self.launched - 1)

    def flush(self) -> None:
        """Launch every bucket not launched yet (in order) and stop watching."""
        self.armed = False
        while self.launched < len(self._needs):
            self.launched += 1
            self._launch(self.launched - 1)

    def reset(self) -> None:
        """A new step: nothing launched or final."""
        self.armed = False
        self.launched = 0
        self._waiting = list(self._needs)
        self._final = [False] * len(self._final)


class GradBuffer:
    """The flat main gradients of `params` (laid at `offsets`) and their bucket readiness.

    `buckets[b]` lists the [start, end) slices of the buffer that bucket b reduces; buckets
    are launched in index order through `launch(b)`. With `hooked` False the parameters keep
    their `.grad` (tied weights, summed over their owners first) and `take_grads` copies them
    in before the reduction.
    """

    def __init__(self, params: Sequence[nn.Parameter], offsets: Sequence[int], size: int,
                 dtype: torch.dtype, buckets: Sequence[Sequence[tuple[int, int]]],
                 launch: Callable[[int], None], *, hooked: bool = True) -> None:
        self.params = list(params)
        self.offsets = list(offsets)
        self.flat = torch.zeros(size, dtype=dtype)
        """The main gradients, padded to the shard layout's size."""
        self.hooked = hooked
        members: list[list[int]] = [
            [k for k, (param, offset) in enumerate(zip(self.params, self.offsets))
             if any(offset < end and start < offset + param.numel() for start, end in slices)]
            for slices in buckets]  # bucket b waits for the parameters meeting its slices
        self.members = members
        self._index = {id(param): k for k, param in enumerate(self.params)}
        """The parameter indices each bucket waits for."""
        self.before_launch: Callable[[Sequence[nn.Parameter]], None] | None = None
        """Called with a bucket's parameters right before it is launched (the deferred tp
        sum of partial gradients, `pipeline.parallel.partial_grad_reducer`)."""
        self._launch = launch
        self.launches = BucketLaunches(members, len(self.params), self._launch_bucket)
        self._stale = False
        self._handles: list[RemovableHandle] = []
        if hooked:
            self._handles = [param.register_post_accumulate_grad_hook(self._hook(k))
                             for k, param in enumerate(self.params)]

    def arm(self) -> None:
        """The next backward is this region's last of the step: launch buckets as they fill."""
        self.launches.arm()

    def flush(self) -> None:
        """Launch every bucket not launched yet (in order) and stop watching."""
        self._refresh()
        self.launches.flush()

    def take_grads(self) -> None:
        """Add any `.grad` the parameters hold into the buffer and drop it (unhooked
        parameters; gradients accumulated before the hooks existed)."""
        self._refresh()
        for param, offset in zip(self.params, self.offsets):
            if param.grad is not None:
                self.flat[offset:offset + param.numel()].add_(param.grad.reshape(-1))
                param.grad = None

    def main_grad(self, param: nn.Parameter) -> torch.Tensor:
        """`param`'s slice of the buffer, its accumulated gradient (a `.grad` it still holds
        is added in first)."""
        self._refresh()
        k = self._index[id(param)]
        view = self.flat[self.offsets[k]:self.offsets[k] + param.numel()]
        if param.grad is not None:
            view.add_(param.grad.reshape(-1))
            param.grad = None
        return view.view_as(param)

    def _launch_bucket(self, b: int) -> None:
        if self.before_launch is not None:
            self.before_launch([self.params[k] for k in self.members[b]])
        self._launch(b)

    def zero(self) -> None:
        """Start a new step: nothing launched or final; the buffer is emptied when the next
        gradient arrives (until then it still holds the last step's reduced gradients)."""
        self._stale = True
        self.launches.reset()

    def _refresh(self) -> None:
        if self._stale:
            self.flat.zero_()
            self._stale = False

    def remove_hooks(self) -> None:
        """Detach from the parameters (their gradients stay in `.grad` again)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, k: int) -> Callable[[torch.Tensor], None]:
        param, offset = self.params[k], self.offsets[k]

        def accumulate(tensor: torch.Tensor) -> None:
            grad = tensor.grad
            if grad is None:
                return
            self._refresh()
            with torch.no_grad():
                self.flat[offset:offset + param.numel()].add_(grad.reshape(-1))
            tensor.grad = None
            if self.launches.armed:
                self.launches.final(k)
        return accumulate
