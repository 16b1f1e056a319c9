"""Emulated ZeRO collectives: reduce-scatters and all-gathers as timed waits on a link.

`EmulatedZeroCollectives` is a `pipeline.parallel.zero_comm.ZeroCollectives` (install it with
`ShardedOptimizer.use_collectives`): each collective is a timed wait on the rank's link, which
runs one collective at a time and starts one when the rank has issued it and the link is free;
its handle's `wait` returns at the collective's nominal end (`emulated.Clock`). No bytes move:
an all-gather writes this rank's piece into every rank's place, a reduction leaves the
gradients as they are (the dp ranks run the same ops, so each rank's timing is the group's,
and ranks > cores still overlap for real, as in `emulated_tp`). Use it to time, never to train.

Costs (`EmulatedLinkCosts`): the ring's bytes per link, (d-1)/d · n for an all-gather or a
reduce-scatter of a whole of n bytes over d ranks, at `byte_seconds` each, plus d-1 hops of
`latency` (the planner's `allreduce_seconds` / 2 on a link of bandwidth 1 / `byte_seconds`).
`layer_costs` gives `schedules.analysis.zero_exposure` the same seconds for a prediction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from pipeline.errors import PipelineConfigError
from pipeline.parallel.zero_collectives import BucketReduction, Launched, Waitable
from pipeline.parallel.zero_comm import ZeroCollectives
from pipeline.rehearsal.emulated import WALL_CLOCK, Clock, EmulatedCost
from schedules.analysis.zero_exposure import ZeroLayerCosts

__all__ = ["EmulatedLinkCosts", "EmulatedZeroCollectives", "layer_costs"]


@dataclass(frozen=True, kw_only=True)
class EmulatedLinkCosts:
    """Nominal seconds of the emulated collectives."""

    byte_seconds: float
    """Seconds per byte through a rank's link."""
    latency: float = 0.0
    """Seconds of one hop of the ring (d-1 a collective)."""

    def __post_init__(self) -> None:
        for name in ("byte_seconds", "latency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not math.isfinite(value) or value < 0:
                raise PipelineConfigError(f"emulated link {name} must be a finite number "
                                          f">= 0, got {value!r}")

    def ring(self, nbytes: float, ranks: int) -> float:
        """Seconds of an all-gather or reduce-scatter of a whole of `nbytes` over `ranks`."""
        if ranks <= 1:
            return 0.0
        return (ranks - 1) * (self.latency + nbytes / ranks * self.byte_seconds)


class _Timed:
    """A collective in flight until `deadline` on the link."""

    def __init__(self, deadline: float, clock: Clock) -> None:
        self.deadline, self.clock = deadline, clock

    def wait(self) -> bool:
        if self.deadline > self.clock.now():  # an arrived one leaves the clock where it is
            self.clock.sleep_until(self.deadline, "zero-wait")
        return True


class EmulatedZeroCollectives(ZeroCollectives):
    """ZeRO's collectives at `costs`' nominal times (module docstring)."""

    def __init__(self, costs: EmulatedLinkCosts, clock: Clock = WALL_CLOCK) -> None:
        self.costs, self.clock = costs, clock
        self._link_free = -math.inf
        self.launched: list[tuple[str, float]] = []
        """(kind, seconds) of every collective launched, in order."""

    def _launch(self, kind: str, nbytes: float, group: ProcessGroup | None) -> _Timed:
        seconds = self.costs.ring(nbytes, dist.get_world_size(group))
        self._link_free = max(self.clock.now(), self._link_free) + seconds
        self.launched.append((kind, seconds))
        return _Timed(self._link_free, self.clock)

    def reduce_bucket(self, way: str, bucket: BucketReduction) -> Launched:
        whole = bucket.flat_grad[slice(*bucket.layout.bucket(bucket.b))]
        return [(self._launch("reduce_scatter", whole.numel() * whole.element_size(),
                              bucket.group), None)]

    def gather_flat(self, out: torch.Tensor, local: torch.Tensor,
                    group: ProcessGroup | None) -> Waitable:
        with torch.no_grad():
            out.view(-1, local.numel()).copy_(local.reshape(1, -1))
        return self._launch("all_gather", out.numel() * out.element_size(), group)

    def gather_pieces(self, outputs: list[torch.Tensor], local: torch.Tensor,
                      group: ProcessGroup | None) -> Waitable:
        with torch.no_grad():
            for out in outputs:
                out.copy_(local)
        return self._launch("all_gather", sum(o.numel() * o.element_size() for o in outputs),
                            group)


def layer_costs(cost: EmulatedCost, link: EmulatedLinkCosts, dp: int, *, first: bool,
                element_bytes: int = 4) -> ZeroLayerCosts:
    """One emulated layer's seconds for `zero_exposure`: its gather and its one-bucket
    reduction of `cost.param_elements` elements over `dp` ranks; the model's `first` layer
    runs no input gradient."""
    nbytes = cost.param_elements * element_bytes
    return ZeroLayerCosts(forward=cost.forward, weight_grad=cost.weight_grad,
                          input_grad=0.0 if first else cost.input_grad,
                          gather=link.ring(nbytes, dp), reduce=link.ring(nbytes, dp))
