"""The mark a layer puts on the part of it selective recomputation drops (`recompute_region`),
and the switch a stage sets around the layers its policy selects (`selective_recompute`).

A shared leaf (torch only), so layers in any room can mark their attention core: the
engine's tensor-parallel block as much as the demo's and Hugging Face's. The policy that
decides which layers recompute is `pipeline.model.recompute`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Generic, TypeVar

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["ForwardOnce", "recompute_region", "selective_recompute"]

_T = TypeVar("_T")
_SELECTIVE: ContextVar[bool] = ContextVar("pipesched_selective_recompute", default=False)


@contextmanager
def selective_recompute(enabled: bool) -> Iterator[None]:
    """Inside: `recompute_region` checkpoints what it runs when `enabled` (set by the stage
    around each layer its policy selects)."""
    token = _SELECTIVE.set(enabled)
    try:
        yield
    finally:
        _SELECTIVE.reset(token)


class ForwardOnce(Generic[_T]):
    """`fn` whose later calls (torch's checkpoint recomputing it during the backward) leave
    the buffers of `modules` as they were: BatchNorm's running statistics (and any buffer a
    forward updates) count each microbatch once, as without recomputation. torch's own
    checkpoint updates them again in the recompute."""

    def __init__(self, fn: Callable[..., _T], modules: Sequence[nn.Module]) -> None:
        self.fn = fn
        self.modules = modules
        self.called = False

    def __call__(self, *args: Any) -> _T:
        if not self.called:
            self.called = True
            return self.fn(*args)
        saved = [(buffer, buffer.clone()) for module in self.modules
                 for buffer in module.buffers()]
        try:
            return self.fn(*args)
        finally:
            with torch.no_grad():
                for buffer, value in saved:
                    buffer.copy_(value)


def recompute_region(fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)``, the part of a layer selective recomputation drops: under a stage whose
    policy selects this layer (and while gradients are recorded), only `args` are kept and
    `fn` runs again in the backward; anywhere else, a plain call.

    The random state is replayed (torch's ``preserve_rng_state``), so dropout inside `fn`
    draws the same mask twice.
    """
    if not _SELECTIVE.get() or not torch.is_grad_enabled():
        return fn(*args)
    # the recompute runs outside this context: nested regions inside fn run plainly then
    owner = getattr(fn, "__self__", None)  # a bound method of a module: keep its buffers
    modules = [owner] if isinstance(owner, nn.Module) else []
    with selective_recompute(False):
        return checkpoint(ForwardOnce(fn, modules), *args, use_reentrant=False)
