"""ZeRO-3 inside pipeline stages: each layer's parameters kept as shards, gathered for use.

Legend as in `pipeline.parallel.zero_layout` (d = dp size, a region's k buckets of d·s
elements, rank r's (k, s) shard). Here a region is one *unit*: a layer of a stage (its
parameters laid end to end). Between uses a unit's flat parameter buffer has no storage
(size 0; the parameters stay views of it, as FSDP frees them), and the rank holds only its
fp32 (k, s) master. The unit is all-gathered (one all_gather_single per bucket, into the
buffer's own storage) before its forward and before its backward, and freed:

    reshard_after_forward=True   F: gather, run, free.  B / I / W: gather when a layer's
                                 output gradient arrives (a hook on the output tensors, which
                                 fires for B, I and for W's per-layer backward alike), free
                                 the stage's later units once every output of the layer has
                                 its gradient (their backward is done), and the units whose
                                 backward did not begin in this autograd call; every unit at
                                 the end of each B / W (`backward_done`).
    reshard_after_forward=False  gathered at its first forward, kept through the step's
                                 forwards and backwards, freed at the step (torchtitan's
                                 `reshard_after_forward=False`: fewer gathers, more memory).

Prefetch (`prefetch_next_unit`, FSDP's forward / backward prefetch): a forward launches the
next unit's gather (async) before running its own layer, a backward the previous unit's, so
one unit's gather is in flight while another computes (two units gathered at a time, not one).
Every replica launches it at the same hook, so the gathers keep one order per group.

Gradients are ZeRO-2's (`GradShardedOptimizer`): reduce-scattered per backward into the shard.

Why not torch's `fully_shard` (FSDP2): it drives gathering and resharding from module
forward / backward hooks that assume one forward is followed by its backward and that the
whole backward of a module runs at once, and it reduce-scatters when its own post-backward
hook decides a module's backward is done. Our interpreter runs F of microbatch i+1 between
F and B of microbatch i, splits B into I and W (W differentiates each layer alone, later,
from a captured output gradient), and must issue every collective at the same point on every
replica. So the same collectives are driven from the instruction stream instead. Parameter
gathers use their own process group (`gather_group`): they are issued from hooks whose place
among the gradient reductions may differ by replica, and collectives only match in order
within one group.

Tied weights (the `TIED_REGION`) are not parameter-sharded: they stay whole, as under ZeRO-2.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.distributed import ProcessGroup
from torch.utils.hooks import RemovableHandle

from pipeline.parallel.data_parallel import DEFAULT_BUCKET_MB
from pipeline.parallel.optimizer import OptimizerFactory
from pipeline.parallel.tied_sync import TIED_REGION
from pipeline.parallel.zero2 import GradShardedOptimizer
from pipeline.parallel.zero_collectives import Waitable
from pipeline.parallel.zero_region import Collective, aliases

__all__ = ["UNIT_STRIDE", "FullyShardedOptimizer"]

UNIT_STRIDE = 1 << 16
"""Region key of stage s's unit u: s · UNIT_STRIDE + u (sorted like the stages' layers)."""


class FullyShardedOptimizer(GradShardedOptimizer):
    """ZeRO-3: `units_by_stage[s]` lists stage s's layers (modules), each one unit sharded
    over `group` (of a layer's parameters, those `select` accepts: the expert-parallel form
    holds dense and expert ones in two of these); `tied` parameters form one unsharded
    region. Reducer and optimizer, as `ShardedOptimizer`; call `finish_param_gather` before
    reading parameters outside a forward (it gathers every unit; the next forward or step
    frees them again)."""

    def __init__(self, units_by_stage: Mapping[int, Sequence[nn.Module]],
                 optimizer_factory: OptimizerFactory, group: ProcessGroup | None, *,
                 gather_group: ProcessGroup | None, tied: Sequence[nn.Parameter] = (),
                 reshard_after_forward: bool = True, bucket_mb: float = DEFAULT_BUCKET_MB,
                 average: bool = True, collective: Collective = "auto",
                 select: Callable[[nn.Parameter], bool] | None = None,
                 prefetch_next_unit: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(f"reshard_after_forward must be True or False, got "
                            f"{reshard_after_forward!r}")
        self.reshard_after_forward = reshard_after_forward
        """Free each unit after its forward and re-gather it for its backward."""
        self.gather_group = gather_group
        tied_ids = {id(p) for p in tied}
        regions: dict[int, list[nn.Parameter]] = {TIED_REGION: list(tied)} if tied else {}
        self.units_of_stage: dict[int, list[int]] = {}
        """Stage -> the region keys of its units, in layer order."""
        modules: dict[int, nn.Module] = {}
        seen = set(tied_ids)
        for stage in sorted(units_by_stage):
            self.units_of_stage[stage] = []
            for position, layer in enumerate(units_by_stage[stage]):
                params = [p for p in layer.parameters() if p.requires_grad
                          and id(p) not in seen and (select is None or select(p))]
                seen.update(id(p) for p in params)
                if params:
                    key = stage * UNIT_STRIDE + position
                    regions[key], modules[key] = params, layer
                    self.units_of_stage[stage].append(key)
        self._gathered: set[int] = set()
        self.prefetch_next_unit = prefetch_next_unit
        """Launch the next unit's gather before this one's compute (the previous one's in a
        backward): one unit in flight while one computes."""
        self._in_flight: dict[int, list[tuple[Waitable, torch.Tensor]]] = {}
        """Unit -> its launched, unwaited bucket gathers (and their sources)."""
        self._in_backward: set[int] = set()
        """Units whose output gradient arrived in the running autograd call (cleared at its
        end by an engine callback, as FSDP's post-backward one)."""
        self._exposed: set[int] = set()
        """Units gathered for reading outside a forward, whose values may have been set."""
        super().__init__(regions, optimizer_factory, group, bucket_mb=bucket_mb,
                         average=average, collective=collective)
        self._stage_of = {key: stage for stage, keys in self.units_of_stage.items()
                          for key in keys}
        self._handles: list[RemovableHandle] = []
        for key, layer in modules.items():
            self._handles += [layer.register_forward_pre_hook(self._before_forward(key)),
                              layer.register_forward_hook(self._after_forward(key))]
        for key in self._stage_of:
            self._gathered.add(key)  # built whole from the model's values
            self.free(key)

    # -- gathering and freeing ---------------------------------------------------------------

    def gather(self, key: int) -> None:
        """All-gather unit `key`'s parameters from every rank's master shard and wait for
        them (collective over `gather_group`; a prefetched unit: only the wait)."""
        self.prefetch(key)
        self._wait_gather(key)

    def prefetch(self, key: int) -> None:
        """Launch unit `key`'s all-gather without waiting (nothing when gathered or launched
        already); `gather` (or `free`) waits for it."""
        if key in self._gathered:
            return
        region = self._regions[key]
        flat, layout = region.flat_param, region.layout
        flat.untyped_storage().resize_(layout.size * flat.element_size())
        launched = []
        with torch.no_grad():
            for b in range(layout.num_buckets):
                mine = region.master.detach()[b].to(flat.dtype)
                self.stats.record("all_gather", mine)
                launched.append((self.comm.gather_flat(
                    flat[slice(*layout.bucket(b))], mine, self.gather_group),
                    mine))  # the source stays alive until the wait
        self._in_flight[key] = launched
        self._gathered.add(key)

    def _wait_gather(self, key: int) -> None:
        for work, _ in self._in_flight.pop(key, ()):
            work.wait()

    def free(self, key: int, *, keep_writes: bool = True) -> None:
        """Drop unit `key`'s gathered parameters (their storage; the views stay). A unit
        gathered by `finish_param_gather` may have been written (a checkpoint load): with
        `keep_writes` this rank's piece of it goes back into the master first."""
        if key not in self._gathered:
            return
        self._wait_gather(key)  # never drop storage a gather still writes
        region = self._regions[key]
        if key in self._exposed and keep_writes:
            with torch.no_grad():  # only what was written: a half copy of an unwritten
                # master would round the master to the half dtype
                mine = region.layout.shard(region.flat_param, self.dp_rank)
                written = mine != region.master.to(mine.dtype)
                region.master.copy_(torch.where(written, mine.to(region.master.dtype),
                                                region.master))
        self._exposed.discard(key)
        region.flat_param.untyped_storage().resize_(0)
        self._gathered.discard(key)

    def gathered_units(self) -> frozenset[int]:
        """The units whose parameters are gathered now."""
        return frozenset(self._gathered)

    def unit_storage_bytes(self) -> int:
        """Bytes the units' flat parameter buffers hold now (0 when none is gathered)."""
        return sum(self._regions[key].flat_param.untyped_storage().nbytes()
                   for key in self._stage_of)

    def finish_param_gather(self) -> None:
        """Gather every unit, to read parameters outside a forward (collective)."""
        super().finish_param_gather()
        for key in self._stage_of:
            self.gather(key)
            self._exposed.add(key)

    # -- the reducer role --------------------------------------------------------------------

    def reduce_stage(self, stage_index: int, params: Sequence[nn.Parameter]) -> None:
        """Launch what the stage's units have left to reduce (the tied region: as ZeRO-2)."""
        if stage_index not in self.units_of_stage:
            super().reduce_stage(stage_index, params)
            return
        keys = self.units_of_stage[stage_index]
        mine = {id(p) for key in keys for p in self._regions[key].params}
        trainable = {id(p) for p in params if p.requires_grad}
        if trainable != mine:
            raise ValueError(f"reduce_stage({stage_index}) got {len(trainable)} trainable "
                             f"parameters but the stage's units hold {len(mine)} different "
                             f"ones; pass the parameters of the layers given for the stage")
        for key in keys:
            if self._regions[key].reduced:
                raise RuntimeError(f"stage {stage_index} was reduced twice in one step; call "
                                   f"step() (or zero_grad()) between steps")
            self._launch_reduce(self._regions[key])

    def backward_done(self, stage_index: int) -> None:
        """One B or W of the stage ended: launch its units' unfilled buckets; free them."""
        for key in self.units_of_stage.get(stage_index, ()):
            store = self._regions[key].store
            if store is not None:
                store.backward_done()
            if self.reshard_after_forward:
                self.free(key)

    # -- the optimizer role ------------------------------------------------------------------

    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """Take back what was written into exposed units, then step as ZeRO-1 / 2."""
        self.take_back_writes()
        super().step(closure)

    def take_back_writes(self) -> None:
        """Free the units `finish_param_gather` exposed, keeping what was written into this
        rank's piece of them (before the masters step)."""
        for key in list(self._exposed):
            self.free(key)

    def publish(self) -> None:
        """After the masters stepped: free every unit (the next forward gathers the new
        values) and all-gather the unsharded tied region as ZeRO-1 does."""
        self._release_fp32_grads()
        for key in self._stage_of:
            self.free(key, keep_writes=False)
        for key, region in self._regions.items():  # the tied region of half parameters
            if key not in self._stage_of and not aliases(region.master, region.flat_param):
                region.layout.shard(region.flat_param, self.dp_rank).copy_(
                    region.master.detach())
        self.param_gather.launch([(key, region.flat_param, region.layout)
                                  for key, region in self._regions.items()
                                  if key not in self._stage_of])
        for region in self._regions.values():
            region.reduced = False

    def _master_is_view(self, key: int) -> bool:
        return key == TIED_REGION  # a unit's parameters come and go: its master is a copy

    # -- hooks -------------------------------------------------------------------------------

    def _before_forward(self, key: int) -> Callable[[nn.Module, Any], None]:
        def gather_unit(module: nn.Module, args: Any) -> None:
            del module, args
            self.gather(key)
            self._prefetch_beside(key, +1)
        return gather_unit

    def _prefetch_beside(self, key: int, step: int) -> None:
        """Prefetch the unit `step` places from `key` in its stage (none past either end)."""
        if not self.prefetch_next_unit:
            return
        units = self.units_of_stage[self._stage_of[key]]
        index = units.index(key) + step
        if 0 <= index < len(units):
            self.prefetch(units[index])

    def _after_forward(self, key: int) -> Callable[[nn.Module, Any, Any], None]:
        def reshard_unit(module: nn.Module, args: Any, output: Any) -> None:
            del module, args
            if torch.is_grad_enabled():
                hooked = [tensor for tensor in _tensors(output) if tensor.requires_grad]
                remaining = [len(hooked)]  # outputs of this forward still awaiting a gradient
                for tensor in hooked:
                    tensor.register_hook(self._before_backward(key, remaining))
            if self.reshard_after_forward:
                self.free(key)
        return reshard_unit

    def _before_backward(self, key: int, remaining: list[int]
                         ) -> Callable[[torch.Tensor], None]:
        # Why count outputs: a layer's outputs may get their gradients far apart (an MoE
        # layer's balancing-loss scalar, carried with the activations to the loss, may get
        # its gradient only after the stage's earlier layers began their backward). Once
        # every output of this forward has its gradient, all its consumers, the stage's
        # later layers, are done with theirs; so is every unit whose backward did not begin
        # in this autograd call (a former call's leftover, as I leaves its last layer for W).
        # Those go; earlier units that began in this call may still be running.
        def gather_for_backward(grad: torch.Tensor) -> None:
            del grad
            remaining[0] -= 1
            if not self._in_backward:  # the first hook of this autograd call
                Variable._execution_engine.queue_callback(self._in_backward.clear)
            self._in_backward.add(key)
            if self.reshard_after_forward and remaining[0] <= 0:
                for other in self.units_of_stage[self._stage_of[key]]:
                    if other > key or other not in self._in_backward:
                        self.free(other)
            self.gather(key)
            self._prefetch_beside(key, -1)
        return gather_for_backward


def _tensors(output: Any) -> list[torch.Tensor]:
    """The floating tensors of a layer's output (a tensor, or a tuple / list / dict of them)."""
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() else []
    if isinstance(output, tuple | list):
        return [t for item in output for t in _tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _tensors(item)]
    return []
