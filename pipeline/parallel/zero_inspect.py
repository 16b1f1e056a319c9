"""What a ZeRO optimizer holds, read back: bytes by kind, shards, layouts, gathered gradients.

Legend as in `pipeline.parallel.zero_layout`: d = dp size, a region's (k, s) shard is this
rank's r-th piece of each of its k buckets. A mixin of `ShardedOptimizer` (and so of its
ZeRO-2 / 3 forms): every method only reads the regions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from pipeline.parallel.grad_buffer import GradBuffer
from pipeline.parallel.param_gather import BucketKey
from pipeline.parallel.zero_layout import ShardLayout
from pipeline.parallel.zero_region import ShardRegion, aliases

__all__ = ["ShardInspection"]


class ShardInspection:
    """Read-only views of a ZeRO optimizer's regions (see the module docstring)."""

    _regions: dict[int, ShardRegion]
    _buckets_of: dict[int, list[BucketKey]]
    optimizer: torch.optim.Optimizer
    group: ProcessGroup | None
    dp_size: int
    dp_rank: int

    def region_parameters(self) -> dict[int, list[torch.nn.Parameter]]:
        """Region key -> its parameters, in layout order (what checkpoints describe)."""
        return {key: list(region.params) for key, region in self._regions.items()}

    def _step_grad(self, region: ShardRegion) -> torch.Tensor:
        grad = region.master.grad
        if grad is None:
            raise RuntimeError("the gradient shards are read before wait(): call wait() (or "
                               "clip_grad_norm_ / step) first")
        return grad

    def gather_grads(self) -> dict[int, torch.Tensor]:
        """id(parameter) -> its full reduced gradient, all-gathered from every dp rank's shard
        (collective over the group). Read after `wait` or `step` (clipped and unscaled as the
        step saw it). For checks and debugging: it materialises what ZeRO-1 avoids holding."""
        full: dict[int, torch.Tensor] = {}
        for region in self._regions.values():
            shard = self._step_grad(region).clone(memory_format=torch.contiguous_format)
            parts = [torch.empty_like(shard) for _ in range(self.dp_size)]
            dist.all_gather(parts, shard, group=self.group)
            flat = torch.stack(parts, dim=1).reshape(-1)  # (k, d, s): the buffer's order
            for param, offset in zip(region.params, region.offsets):
                full[id(param)] = flat[offset:offset + param.numel()].view(param.shape).clone()
        return full

    def state_bytes(self) -> int:
        """Bytes of the optimizer-state tensors (moments etc.) held by this rank."""
        return sum(value.numel() * value.element_size()
                   for state in self.optimizer.state.values()
                   for value in state.values() if isinstance(value, torch.Tensor))

    def master_bytes(self) -> int:
        """Bytes of the fp32 master shards held apart from the parameters (0 when the
        parameters are fp32: each master is then a view of them)."""
        return sum(r.master.numel() * r.master.element_size() for r in self._regions.values()
                   if not aliases(r.master, r.flat_param))

    def gradient_buffer_bytes(self) -> int:
        """Bytes of the gradients held: ZeRO-1's whole main-gradient buffer per region and
        the fp32 copies of this rank's shard where it is not fp32 (fp16, after `wait`);
        ZeRO-2/3's shard per region and the bucket buffers still alive (none after `wait`)."""
        total = 0
        for r in self._regions.values():
            held = [] if r.grads is None else [r.flat_grad]
            if r.store is not None:
                total += r.store.transient_bytes()
                held.append(r.store.shard)
            held += [g for g in [r.master.grad] if g is not None
                     and not any(aliases(g, base) for base in held)]
            total += sum(t.numel() * t.element_size() for t in held)
        return total

    def transient_bytes(self) -> int:
        """Bytes of ZeRO-2 / 3 gradient bucket buffers alive now (filling or on the wire;
        none after `wait`), which `held_tensors` leaves out."""
        return sum(r.store.transient_bytes() for r in self._regions.values()
                   if r.store is not None)

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this object keeps beyond the inner optimizer's state, by kind:
        'parameters' (flat buffers), 'gradients' (main-gradient buffers, shard gradients),
        'masters' (for counting live bytes; views share their base's storage)."""
        held: dict[str, list[torch.Tensor]] = {"parameters": [], "gradients": [],
                                               "masters": []}
        for region in self._regions.values():
            held["parameters"].append(region.flat_param)
            if region.grads is not None:
                held["gradients"].append(region.flat_grad)
            if region.store is not None:
                held["gradients"].append(region.store.shard)
            if region.master.grad is not None:
                held["gradients"].append(region.master.grad)
            held["masters"].append(region.master)
        return held

    def masters(self) -> list[torch.Tensor]:
        """Each region's fp32 (k, s) master shard, in region order."""
        return [region.master for region in self._regions.values()]

    def piece_tensors(self) -> dict[tuple[int, int], torch.nn.Parameter]:
        """(id(parameter), bucket) -> the view of the master the inner optimizer steps."""
        return {(id(piece.param), piece.bucket): piece.tensor
                for region in self._regions.values() for piece in region.pieces}

    def shard_state(self, name: str) -> list[torch.Tensor]:
        """Each region's (k, s) shard of the per-element optimizer state `name` (e.g.
        Adam's 'exp_avg'), zero where no piece holds it (padding, unstepped parameters)."""
        shards = []
        for region in self._regions.values():
            shard = torch.zeros_like(region.master, dtype=torch.float32)
            for piece in region.pieces:
                value = self.optimizer.state.get(piece.tensor, {}).get(name)
                if value is not None:
                    shard[piece.bucket, piece.row] = value
            shards.append(shard)
        return shards

    def layouts(self) -> dict[int, ShardLayout]:
        """Region key -> where its buckets and this group's shards lie in its flat buffer."""
        return {key: region.layout for key, region in self._regions.items()}

    def grad_buffers(self) -> list[GradBuffer]:
        """The regions' main-gradient buffers (ZeRO-1's whole ones; none under ZeRO-2 / 3)."""
        return [region.grads for region in self._regions.values() if region.grads is not None]

    def buckets_of(self, param: torch.nn.Parameter) -> list[BucketKey]:
        """The (region key, bucket index) pairs holding `param`'s elements."""
        return list(self._buckets_of.get(id(param), []))
