"""ZeRO-1's parameter all-gather, per bucket: blocking, or overlapped with the next forward.

After the optimizer steps its shard, each rank holds updated values only for the pieces it owns
(`pipeline.parallel.zero_layout`); one all-gather per bucket brings every rank the rest. Blocking,
the step waits for all of them. Overlapped (Megatron's `overlap_param_gather`), the gathers are
launched in forward order (the buffer's head first) and left in flight; a forward pre-hook on
each watched module waits only for the buckets holding that module's parameters, so the first
layers start while the later buckets are still on the wire. Whatever reads parameters outside
a forward (checkpoints, the next optimizer step, a user between steps) must call `wait()`
first: a parameter read before its bucket arrived holds the previous step's value on the
pieces other ranks own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.hooks import RemovableHandle

from pipeline.parallel.data_parallel import CommStats
from pipeline.parallel.zero_collectives import Waitable
from pipeline.parallel.zero_comm import ZeroCollectives
from pipeline.parallel.zero_layout import ShardLayout

__all__ = ["BucketKey", "ParamGather"]

BucketKey = tuple[int, int]
"""(region key, bucket index)."""


class ParamGather:
    """Launches and completes the per-bucket all-gathers of updated parameters.

    `launch` starts one all-gather per bucket of every region (in forward order); with
    `overlap` False it also waits for them. `wait(buckets)` completes the named buckets (all
    of them by default); `watch(modules, buckets_of)` makes each module's forward wait for
    the buckets its parameters meet. `wait_seconds` adds up the time spent blocked in waits.
    """

    def __init__(self, group: ProcessGroup | None, dp_rank: int, stats: CommStats, *,
                 overlap: bool) -> None:
        self.group = group
        self.dp_rank = dp_rank
        self.stats = stats
        self.overlap = overlap
        """Leave the gathers in flight after `launch` (the next forward waits for them)."""
        self.comm = ZeroCollectives()
        """What launches the gathers (`ShardedOptimizer.use_collectives`)."""
        self.wait_seconds = 0.0
        """Seconds spent blocked waiting for gathers (exposed gather time), accumulated."""
        self._pending: dict[BucketKey, tuple[Waitable, torch.Tensor]] = {}

    @property
    def in_flight(self) -> frozenset[BucketKey]:
        """The buckets whose gathers were launched and not waited for yet."""
        return frozenset(self._pending)

    def launch(self, regions: Sequence[tuple[int, torch.Tensor, ShardLayout]]) -> None:
        """All-gather each (key, flat parameters, layout) region's buckets, in the order given
        and the head of each buffer first (the order the next forward needs them)."""
        self.wait()  # a gather still in flight would race the new one into the same buffer
        for key, flat, layout in regions:
            if layout.dp_size == 1:
                continue
            for b in range(layout.num_buckets):
                outputs = [flat[slice(*layout.owned(b, q))] for q in range(layout.dp_size)]
                mine = outputs[self.dp_rank].clone()  # the input must not alias an output
                self.stats.record("all_gather", mine)
                self._pending[(key, b)] = (self.comm.gather_pieces(outputs, mine, self.group),
                                           mine)
        if not self.overlap:
            self.wait()

    def wait(self, buckets: Iterable[BucketKey] | None = None) -> None:
        """Block until the named buckets' gathers (None: every one in flight) have arrived."""
        if not self._pending:
            return
        keys = list(self._pending) if buckets is None else [
            key for key in buckets if key in self._pending]
        if not keys:
            return
        start = time.perf_counter()
        for key in keys:
            work, _ = self._pending.pop(key)
            work.wait()
        self.wait_seconds += time.perf_counter() - start

    def watch(self, modules: Iterable[nn.Module],
              buckets_of: Mapping[int, Sequence[BucketKey]]) -> list[RemovableHandle]:
        """A forward pre-hook on each module: wait for the buckets (`buckets_of[id(param)]`)
        of the parameters it holds, its submodules' included."""
        handles = []
        for module in modules:
            needed = sorted({key for param in module.parameters()
                             for key in buckets_of.get(id(param), ())})
            if needed:
                handles.append(module.register_forward_pre_hook(self._waiter(needed)))
        return handles

    def _waiter(self, needed: list[BucketKey]) -> Callable[[nn.Module, object], None]:
        def wait_for_buckets(module: nn.Module, args: object) -> None:
            del module, args
            self.wait(needed)
        return wait_for_buckets

