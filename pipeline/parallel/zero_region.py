"""One ZeRO region's tensors, and the choice of the collective that reduces its gradients.

Legend as in `pipeline.parallel.zero_layout`: a region's parameters are laid end to end in one
flat buffer of k buckets of d·s elements; rank r owns the r-th d-th of every bucket.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from pipeline.parallel.grad_buffer import GradBuffer
from pipeline.parallel.zero_collectives import Launched
from pipeline.parallel.zero_grad_store import ShardGradStore
from pipeline.parallel.zero_groups import ShardPiece
from pipeline.parallel.zero_layout import ShardLayout

__all__ = ["Collective", "ResolvedCollective", "ShardRegion", "aliases", "choose_collective",
           "detect_reduce_scatter"]

Collective = Literal["auto", "reduce_scatter", "reduce", "all_reduce", "all_to_all"]
ResolvedCollective = Literal["reduce_scatter", "reduce", "all_reduce", "all_to_all"]


@dataclass
class ShardRegion:
    """One flat buffer of parameters and this rank's share of its training state."""

    params: list[torch.nn.Parameter]
    offsets: list[int]
    layout: ShardLayout
    flat_param: torch.Tensor
    """The parameters laid end to end (their `.data` are views of it), padded to k·d·s.
    Under ZeRO-3 its storage is freed (size 0) while the parameters are not gathered."""
    master: torch.nn.Parameter
    """This rank's fp32 shard, (k, s), the inner optimizer steps: a strided view of
    `flat_param` when the parameters are fp32 (no second copy; ZeRO-1 and 2), an fp32 copy
    when they are bf16 / fp16, or under ZeRO-3 (whose `flat_param` comes and goes)."""
    pieces: list[ShardPiece] = field(default_factory=list)
    """Where each parameter meets the master: what the inner optimizer's groups hold."""
    grads: GradBuffer | None = None
    """ZeRO-1: the whole main-gradient buffer, reduce-scattered once per step."""
    store: ShardGradStore | None = None
    """ZeRO-2 and 3: the reduced gradient shard, filled bucket by bucket every backward."""
    pending: Launched = field(default_factory=list)
    """Launched bucket reductions, each with what to do once it arrived (all_to_all: sum)."""
    reduced: bool = False

    @property
    def flat_grad(self) -> torch.Tensor:
        """ZeRO-1's main-gradient buffer."""
        if self.grads is None:
            raise RuntimeError("internal error: a ZeRO-1 region without its gradient buffer")
        return self.grads.flat


def aliases(view: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether `view` shares `base`'s memory (a view of it, not a copy)."""
    return view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


def detect_reduce_scatter(group: ProcessGroup | None) -> bool:
    """Whether the group's backend implements reduce_scatter (collective: all ranks call it).

    Older gloo builds raise for reduce_scatter on CPU tensors; the probe is one tiny
    collective, so every rank reaches the same answer.
    """
    size = dist.get_world_size(group)
    out = torch.zeros(1)
    try:
        dist.reduce_scatter(out, [torch.ones(1) for _ in range(size)], group=group)
    except (RuntimeError, NotImplementedError, ValueError):
        return False
    return bool(out.item() == size)


def choose_collective(collective: Collective, group: ProcessGroup | None) -> ResolvedCollective:
    """The collective that reduces gradient buckets over `group` (collective under 'auto'
    on a non-gloo backend: it probes reduce_scatter)."""
    if collective not in ("auto", "reduce_scatter", "reduce", "all_reduce", "all_to_all"):
        raise ValueError(f"collective must be 'auto', 'reduce_scatter', 'reduce', "
                         f"'all_reduce' or 'all_to_all', got {collective!r}")
    if collective != "auto":
        return collective
    if dist.get_backend(group) == "gloo":
        # gloo's reduce_scatter is a full all-reduce underneath: measured on torch 2.13,
        # each rank sends N bytes for an N-byte buffer instead of the ring's (d-1)/d · N.
        # Exchanging the pieces with all_to_all and summing locally sends (d-1)/d · N, but
        # holds a d-piece receive buffer per bucket in flight (up to N when the whole
        # buffer is). collective="reduce" (one in-place reduce per piece) allocates
        # nothing but sends 1.4-1.6x the bytes (bench_3d, d = 2).
        return "all_to_all"
    if detect_reduce_scatter(group):
        return "reduce_scatter"
    warnings.warn(f"backend {dist.get_backend(group)!r} has no reduce_scatter here; ZeRO falls "
                  f"back to all_reduce + slice (same result, {dist.get_world_size(group)}x the "
                  f"gradient traffic)", stacklevel=3)
    return "all_reduce"
