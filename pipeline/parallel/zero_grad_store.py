"""ZeRO-2's gradient shard: each backward's buckets reduce-scattered into it as they fill.

Legend as in `pipeline.parallel.zero_layout`: a region's flat buffer is k buckets of d·s
elements and rank r owns the r-th piece of each; this rank's gradient shard is (k, s).

ZeRO-1 accumulates a pipeline step's m microbatch gradients into one whole buffer and
reduce-scatters it once. ZeRO-2 (Rajbhandari et al., 2020, §5.2) never holds the whole
gradient: during *every* backward, a parameter's gradient is added into a transient buffer
of its bucket (d·s elements) the moment autograd accumulated it; when every parameter of the
bucket has arrived the bucket is reduce-scattered right away, inside the backward, and once
it has arrived this rank adds its piece into the shard and drops the buffer. The cost is the
one DeepSpeed names for refusing ZeRO-2 under its pipeline: m reductions a step instead of one
(here overlapped with each backward, as the data-parallel reduction is).

Every data-parallel replica must issue the same collectives in the same order: buckets
launch strictly in their fixed order (`BucketLaunches`), and `backward_done` (which the
interpreter calls after each B / W, at the same place on every replica) launches the buckets
that did not fill, with zeros where a parameter got no gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from pipeline.parallel.grad_buffer import BucketLaunches
from pipeline.parallel.zero_collectives import Launched
from pipeline.parallel.zero_layout import ShardLayout

__all__ = ["LaunchBucket", "ShardGradStore", "notify_backward_done"]

LaunchBucket = Callable[[int, torch.Tensor], Launched]
"""(bucket b, its d·s transient buffer) -> the launched reduction of it (not waited)."""


class ShardGradStore:
    """The reduced (k, s) gradient shard of one region's `params` (laid at `offsets`).

    `launch(b, buffer)` starts bucket b's reduction; after it finished, this rank's piece of
    `buffer` holds the sum over the group. Unhooked parameters (tied weights, summed over
    their owners first) keep `.grad` until `take_grads`.
    """

    def __init__(self, params: Sequence[nn.Parameter], offsets: Sequence[int],
                 layout: ShardLayout, dtype: torch.dtype, dp_rank: int, launch: LaunchBucket,
                 *, hooked: bool = True,
                 on_send: Callable[[ShardGradStore, torch.Tensor], None] | None = None
                 ) -> None:
        self._on_send = on_send
        """Told of every launched bucket buffer (a bound on the buffers in flight)."""
        self.params, self.offsets = list(params), list(offsets)
        self.layout, self.dp_rank, self._launch = layout, dp_rank, launch
        self.dtype = dtype
        self.shard = torch.zeros(layout.num_buckets, layout.piece, dtype=dtype)
        """This rank's reduced gradients, summed over the step's backwards."""
        self.hooked = hooked
        self.buckets: dict[int, torch.Tensor] = {}
        """Bucket index -> its transient d·s buffer while it fills (then it is on the wire,
        in `_in_flight`, until its piece is added into the shard and it is dropped)."""
        self._in_flight: list[tuple[int, torch.Tensor, Launched]] = []
        self._settled_upto = 0
        """`_in_flight` entries before this index belong to an earlier backward."""
        self._stale = False
        self._dirty = False
        last = layout.num_buckets - 1
        members = [[k for k, (param, offset) in enumerate(zip(self.params, self.offsets))
                    if b in layout.buckets_of(offset, param.numel())]
                   for b in range(last, -1, -1)]  # the tail first: a backward ends there first
        self.launches = BucketLaunches(members, len(self.params),
                                       lambda index: self._send(last - index))
        self.launches.arm()
        self._handles: list[RemovableHandle] = []
        if hooked:
            self._handles = [param.register_post_accumulate_grad_hook(self._hook(k))
                             for k, param in enumerate(self.params)]

    def add(self, k: int, grad: torch.Tensor) -> None:
        """Add parameter k's gradient into its buckets' buffers (allocated on first use)."""
        offset, flat = self.offsets[k], grad.detach().reshape(-1)
        width = self.layout.dp_size * self.layout.piece
        self._dirty = True
        for b in self.layout.buckets_of(offset, flat.numel()):
            start = b * width
            lo, hi = max(start, offset), min(start + width, offset + flat.numel())
            buffer = self.buckets.get(b)
            if buffer is None:
                buffer = self.buckets[b] = torch.zeros(width, dtype=self.dtype)
            buffer[lo - start:hi - start].add_(flat[lo - offset:hi - offset])

    def backward_done(self) -> None:
        """One backward of this region ended: finish the previous backward's reductions
        (still hidden behind this one), launch the buckets this one left unfilled."""
        self._settle(self._settled_upto)
        self.flush()

    def flush(self) -> None:
        """Launch, in order, every bucket not launched since the last flush (if any
        gradient arrived since), then watch the next backward."""
        if self._dirty:
            self.launches.flush()
        self._dirty = False
        self._settled_upto = len(self._in_flight)
        self.launches.reset()
        self.launches.arm()

    def take_grads(self) -> None:
        """Move any `.grad` the parameters hold (unhooked ones) into the buckets."""
        for k, param in enumerate(self.params):
            if param.grad is not None:
                self.add(k, param.grad)
                param.grad = None

    def settle(self) -> torch.Tensor:
        """Launch what is left, wait for every reduction, and return the shard."""
        self.take_grads()
        self.flush()
        self._settle(len(self._in_flight))
        self._refresh()  # a step without any gradient still reads zeros
        return self.shard

    def zero(self) -> None:
        """A new step: the shard is emptied when the next reduced bucket arrives (until then
        it still holds the last step's gradients)."""
        self._stale = True

    def transient_bytes(self) -> int:
        """Bytes of the bucket buffers alive now (filling or on the wire)."""
        alive = [*self.buckets.values(), *(buffer for _, buffer, _ in self._in_flight)]
        return sum(t.numel() * t.element_size() for t in alive)

    def remove_hooks(self) -> None:
        """Detach from the parameters (their gradients stay in `.grad` again)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _send(self, b: int) -> None:
        buffer = self.buckets.pop(b, None)  # the next backward fills a fresh one
        if buffer is None:  # no gradient reached it: the replicas still reduce it together
            buffer = torch.zeros(self.layout.dp_size * self.layout.piece, dtype=self.dtype)
        self._in_flight.append((b, buffer, self._launch(b, buffer)))
        if self._on_send is not None:
            self._on_send(self, buffer)

    def settle_oldest(self, buffer: torch.Tensor) -> bool:
        """Wait for the oldest reduction in flight if its buffer is `buffer` (then add its
        piece into the shard and drop it); False when that one was settled already."""
        if not self._in_flight or self._in_flight[0][1] is not buffer:
            return False
        self._settle(1)
        return True

    def _settle(self, upto: int) -> None:
        done, self._in_flight = self._in_flight[:upto], self._in_flight[upto:]
        self._settled_upto -= min(upto, self._settled_upto)
        if not done:
            return
        self._refresh()
        piece = self.layout.piece
        for b, buffer, works in done:
            for work, finish in works:
                work.wait()
                if finish is not None:
                    finish()
            # the buffer goes with this entry: never held whole once reduced
            self.shard[b].add_(buffer[self.dp_rank * piece:(self.dp_rank + 1) * piece])

    def _refresh(self) -> None:
        if self._stale:
            self.shard.zero_()
            self._stale = False

    def _hook(self, k: int) -> Callable[[torch.Tensor], None]:
        def accumulate(tensor: torch.Tensor) -> None:
            grad = tensor.grad
            if grad is None:
                return
            with torch.no_grad():
                self.add(k, grad)
            tensor.grad = None
            self.launches.final(k)
        return accumulate


def notify_backward_done(reducer: object, stage: int) -> None:
    """Tell a reducer that keeps gradient shards (ZeRO-2 / 3) that one backward (B or W) of
    `stage` ended; other reducers do not listen."""
    hook = getattr(reducer, "backward_done", None)
    if callable(hook):
        hook(stage)
