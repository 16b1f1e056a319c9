"""Measure a P2P link with a ping-pong: one-way latency and bandwidth between two ranks."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from pipeline.parallel.local_p2p import LocalLink
from schedules.analysis.host import Link

__all__ = ["ping_pong", "round_trip"]


def round_trip(tensor: torch.Tensor, peer: int, starts: bool,
               group: dist.ProcessGroup | None = None, link: LocalLink | None = None) -> None:
    """One exchange of `tensor` with global rank `peer` (`starts`: send first), through
    `link` when it carries `tensor` (as the engine's messages go), else through gloo."""
    via = link if link is not None and link.carries(tensor) else None
    for sending in (starts, not starts):
        if via is not None:
            (via.send(tensor, peer) if sending else via.recv(tensor, peer)).wait()
        elif sending:
            dist.send(tensor, peer, group=group)
        else:
            dist.recv(tensor, peer, group=group)


def _round_trips(peer: int, starts: bool, tensor: torch.Tensor, repeats: int,
                 group: dist.ProcessGroup | None, link: LocalLink | None) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        round_trip(tensor, peer, starts, group, link)
        times.append(time.perf_counter() - start)
    return times


def ping_pong(first: int, second: int, nbytes: int, *, repeats: int = 20,
              group: dist.ProcessGroup | None = None, link: LocalLink | None = None) -> Link:
    """The link between global ranks `first` and `second` (a collective over `group`: every
    rank calls it; the others wait at its closing barrier). Messages that an engine's
    `link` (`PipelineEngine.comm.local`) carries go through it, as the engine's do.

    Half the median round trip of a 1-element message is the latency; the extra time of a
    message of `nbytes` gives the bandwidth (None when it is too small to tell).
    """
    if first == second:
        raise ValueError(f"ping_pong needs two different ranks, got {first} twice")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    rank = dist.get_rank()
    measured = Link(0.0)
    if rank in (first, second):
        peer, starts = (second, True) if rank == first else (first, False)
        small = torch.zeros(1)
        large = torch.zeros(max(1, nbytes // 4))
        _round_trips(peer, starts, small, 3, group, link)  # connect, warm the paths
        latency = statistics.median(_round_trips(peer, starts, small, repeats, group,
                                                 link)) / 2
        one_way = statistics.median(_round_trips(peer, starts, large, repeats, group,
                                                 link)) / 2
        extra = one_way - latency
        bandwidth = large.numel() * 4 / extra if extra > 1e-6 and nbytes >= 4096 else None
        measured = Link(latency, bandwidth)
    found: list[Link | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, measured if rank == first else None, group=group)
    result = next(x for x in found if x is not None)
    return result
