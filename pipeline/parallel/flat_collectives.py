"""Flat all-gather and reduce-scatter, under the names the installed torch recommends.

torch 2.13 deprecates `all_gather_into_tensor` / `reduce_scatter_tensor` (a `FutureWarning` on
every call: hundreds of lines a run at tp > 1) in favour of `all_gather_single` /
`reduce_scatter_single`, which older releases in our `torch>=2.4` range lack; the choice is
made once, here, so every caller says what it does and none warns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["all_gather_flat", "reduce_scatter_flat"]

_ALL_GATHER: Callable[..., Any] = getattr(dist, "all_gather_single", None) \
    or dist.all_gather_into_tensor
_REDUCE_SCATTER: Callable[..., Any] = getattr(dist, "reduce_scatter_single", None) \
    or dist.reduce_scatter_tensor


def all_gather_flat(out: torch.Tensor, local: torch.Tensor, group: ProcessGroup | None = None,
                    *, async_op: bool = False) -> Any:
    """Every rank's `local`, concatenated along dim 0 in rank order, into `out`."""
    return _ALL_GATHER(out, local, group=group, async_op=async_op)


def reduce_scatter_flat(out: torch.Tensor, full: torch.Tensor,
                        group: ProcessGroup | None = None, *, async_op: bool = False) -> Any:
    """The sum over ranks of `full`, this rank keeping its slice of dim 0 in `out`."""
    return _REDUCE_SCATTER(out, full, group=group, async_op=async_op)
