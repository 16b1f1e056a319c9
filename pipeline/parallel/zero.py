"""ZeRO-1: optimizer state sharded over the data-parallel group (Rajbhandari et al., 2020).

Legend: d = data-parallel size, r = this rank's index in the dp group, k = a region's buckets,
s = the elements of a bucket one rank owns. A *region* is the set of parameters whose
gradients become final at the same moment: one pipeline stage's parameters (or, with tied
weights, the tied ones, which are final only after the owners' sum). Each region is flattened
into one buffer cut into k equal buckets of d·s elements, and rank r owns the r-th d-th of
every bucket (`pipeline.parallel.zero_layout`, Megatron's distributed-optimizer layout: reduce-
scatter gradients per bucket, step the shard in fp32, all-gather parameters; bytes per
parameter 16 → 8 + 8/d with fp32 Adam state).

When reduction happens: with `last_backward(key)` called before a region's last backward
of the step, each bucket launches from the gradient hooks as soon as it is final, inside that
backward (`pipeline.parallel.grad_buffer`); a bucket's reduce-scatter hands every rank its own
piece, so the buffer's tail (final first) is on the wire while the backward still runs through
the head: the reductions hide behind the whole last backward. `reduce_stage` (the engine's
REDUCE_GRAD) then launches what is left, without blocking, so it overlaps the rank's other
stages; `step` first (through `wait`) reduces any region nobody reduced yet, so the optimizer
also works alone. That reducer role is `pipeline.parallel.zero_reducer`'s `ShardReducer`. The
parameter all-gather after the step is `pipeline.parallel.param_gather`: blocking, or
(`overlap_param_gather`) left in flight for the next forward to wait for.

ZeRO-2 (`pipeline.parallel.zero2`) and ZeRO-3 (`pipeline.parallel.zero3`) are subclasses: they
keep only gradient shards, filled every backward, and (ZeRO-3) gather parameters per layer.
What the optimizer holds is read back by `pipeline.parallel.zero_inspect`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from pipeline.parallel.data_parallel import DEFAULT_BUCKET_MB, CommStats
from pipeline.parallel.grad_buffer import GradBuffer
from pipeline.parallel.optimizer import OptimizerFactory, build_optimizer
from pipeline.parallel.param_gather import BucketKey, ParamGather
from pipeline.parallel.tied_sync import TIED_REGION
from pipeline.parallel.zero_comm import ZeroCollectives
from pipeline.parallel.zero_groups import ShardPiece, carry_groups, cut_pieces
from pipeline.parallel.zero_layout import ShardLayout
from pipeline.parallel.zero_reducer import ShardReducer
from pipeline.parallel.zero_region import (
    Collective,
    ResolvedCollective,
    ShardRegion,
    aliases,
    choose_collective,
    detect_reduce_scatter,
)

__all__ = ["Collective", "ShardedOptimizer", "detect_reduce_scatter"]


class ShardedOptimizer(ShardReducer, torch.optim.Optimizer):
    """A torch optimizer whose state lives only on this rank's 1/d shard of the parameters.

    The factory is called with the model's parameters (this rank's regions', in order) and
    may split them into groups as over a plain model; each group then steps its
    parameters' pieces of the shard (`pipeline.parallel.zero_groups`). `param_groups`,
    `state` and `defaults` are the inner optimizer's own, so torch's LR schedulers drive it
    (``StepLR(sharded, 10)``) as they drive any optimizer.

    Also a `GradReducer`: pass it to the engine as the reducer and the optimizer. Regions are
    keyed like the engine's stages (`params_by_stage`); `reduce_stage(key, params)` must name
    exactly the parameters given for that key. Parameters of one region share a dtype; their
    `.data` becomes a view of the region's flat buffer (so the all-gather writes them in
    place). Their gradients accumulate into the region's main-gradient buffer (fp32, or fp16
    for fp16 parameters, as Megatron's) through hooks and `.grad` stays None (`GradBuffer`);
    the tied region (`TIED_REGION`) keeps `.grad`, which its owners sum first. The optimizer
    steps one fp32 master shard per region, (k, s) (`ShardLayout`): a view of the parameters
    when they are fp32.

    With `overlap_param_gather`, `step` leaves the parameter all-gathers in flight: call
    `watch_forward` on the modules whose forwards read the parameters (each then waits for
    its own buckets), and `finish_param_gather` before reading parameters any other way.

    Bytes per parameter at the step, with Adam (Megatron's distributed-optimizer table):
    fp32 params 4 + main grads 4 + (moments 8)/d; bf16 params 2 + fp32 main grads 4 +
    (master 4 + moments 8)/d; fp16 params 2 + fp16 grads 2 + (fp32 grad 4 + master 4 +
    moments 8)/d.
    """

    def __init__(self, params_by_stage: Mapping[int, Sequence[torch.nn.Parameter]],
                 optimizer_factory: OptimizerFactory, group: ProcessGroup | None, *,
                 bucket_mb: float = DEFAULT_BUCKET_MB, average: bool = True,
                 collective: Collective = "auto", overlap_param_gather: bool = False) -> None:
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        if not isinstance(overlap_param_gather, bool):
            raise TypeError(f"overlap_param_gather must be True or False, got "
                            f"{overlap_param_gather!r}")
        self.group = group
        self.dp_size = dist.get_world_size(group)
        self.dp_rank = dist.get_rank(group)
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.average = average
        self.collective: ResolvedCollective = choose_collective(collective, group)
        """Which collective reduces gradients: reduce_scatter; one in-place reduce per piece
        to its owner (gloo: no buffer); all_to_all of the pieces + a local sum; or all_reduce
        + slice where the backend lacks reduce_scatter (d× the received bytes, same
        result)."""
        self.stats = CommStats()
        self.comm = ZeroCollectives()
        """What launches every reduction and gather (`use_collectives`)."""
        self.param_gather = ParamGather(group, self.dp_rank, self.stats,
                                        overlap=overlap_param_gather)
        """The all-gather of updated parameters after `step` (blocking or overlapped)."""
        self._regions: dict[int, ShardRegion] = {}
        # A parameter listed under two stages goes to the first; give weights shared between
        # stages their own region instead (`pipeline.tied.split_tied`).
        seen: set[int] = set()
        for key in sorted(params_by_stage):
            params = []
            for param in params_by_stage[key]:
                if param.requires_grad and id(param) not in seen:
                    seen.add(id(param))
                    params.append(param)
            if params:
                self._regions[key] = self._build_region(key, params)
        self._buckets_of: dict[int, list[BucketKey]] = {
            id(param): [(key, b) for b in region.layout.buckets_of(offset, param.numel())]
            for key, region in self._regions.items()
            for param, offset in zip(region.params, region.offsets)}
        params = self.model_parameters()
        self.optimizer = build_optimizer(optimizer_factory, params)
        """The user's optimizer, its groups holding this rank's shard pieces."""
        carry_groups(self.optimizer, self.shard_pieces(), params)
        self.share_surface(self.optimizer)

    def share_surface(self, optimizer: torch.optim.Optimizer) -> None:
        """Take `optimizer`'s torch.optim.Optimizer surface as this one's (its __init__ would
        rebuild the groups): LR schedulers write `lr` into the inner's own groups."""
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self.state = optimizer.state
        self.param_groups = optimizer.param_groups
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()

    def use_collectives(self, comm: ZeroCollectives) -> None:
        """Launch every later gradient reduction and parameter gather through `comm` (the
        seam where `pipeline.rehearsal.emulated_zero` times them on an emulated link)."""
        self.comm = comm
        self.param_gather.comm = comm

    def model_parameters(self) -> list[torch.nn.Parameter]:
        """This rank's model parameters held here, in region order (what the factory gets)."""
        return [param for region in self._regions.values() for param in region.params]

    def shard_pieces(self) -> list[ShardPiece]:
        """Where each of them meets this rank's shard (what the inner optimizer steps)."""
        return [piece for region in self._regions.values() for piece in region.pieces]

    # -- the optimizer role -----------------------------------------------------------------

    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """Reduce what is not reduced yet, step the shard, all-gather updated parameters
        (left in flight with `overlap_param_gather`)."""
        self.wait()
        # the masters of fp32 parameters are views of them: a gather still writing the
        # buffer would race the update
        self.param_gather.wait()
        self.optimizer.step()
        self.publish()

    def publish(self) -> None:
        """After the inner optimizer stepped the masters: copy them into the parameters'
        own shards (half parameters) and launch the all-gather of the updated parameters."""
        for region in self._regions.values():
            if not aliases(region.master, region.flat_param):
                region.layout.shard(region.flat_param, self.dp_rank).copy_(
                    region.master.detach())
        self.param_gather.launch([(key, region.flat_param, region.layout)
                                  for key, region in self._regions.items()])
        for region in self._regions.values():
            region.reduced = False

    def finish_param_gather(self) -> None:
        """Complete the parameter all-gathers still in flight (with `overlap_param_gather`):
        call before reading parameters outside a watched forward (checkpoints, evaluation
        by other means, comparisons)."""
        self.param_gather.wait()

    def watch_forward(self, modules: Iterable[torch.nn.Module]) -> None:
        """With `overlap_param_gather`: each module's forward first waits for the buckets
        holding its parameters (a forward pre-hook); the next step's first forward then
        overlaps the gathers of the buckets it does not need yet."""
        self.param_gather.watch(modules, self._buckets_of)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Ready for the next step's backward passes: the gradient buffers empty themselves
        when its first gradient arrives, so the reduced shards stay readable until then
        (`set_to_none` is accepted for torch's signature: model `.grad` is always None)."""
        del set_to_none
        for region in self._regions.values():
            for param in region.params:
                param.grad = None
            if region.grads is not None:
                region.grads.zero()
            if region.store is not None:
                region.store.zero()
            region.reduced = False


    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's `state_dict` (its tensors are this rank's pieces; the
        engine's checkpoints save per parameter instead, loadable under any dp size)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what `state_dict` returned on this rank (same model, dp size and groups)."""
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused: a ZeRO-1 region's layout is fixed when the optimizer is built."""
        raise NotImplementedError(
            "ShardedOptimizer cannot take a parameter group after it was built (the shards are "
            "laid out then); return every group from the optimizer factory")

    # -- internals --------------------------------------------------------------------------

    def _build_region(self, key: int, params: list[torch.nn.Parameter]) -> ShardRegion:
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise TypeError(f"stage {key}'s parameters mix dtypes {sorted(map(str, dtypes))}; "
                            f"a ZeRO region is one flat buffer, cast the stage to one dtype")
        dtype = params[0].dtype
        offsets, numel = [], 0
        for param in params:
            offsets.append(numel)
            numel += param.numel()
        grad_dtype = self._grad_dtype(dtype)
        layout = ShardLayout.plan(numel, self.dp_size,
                                  max(1, self.bucket_bytes // grad_dtype.itemsize))
        flat_param = torch.zeros(layout.size, dtype=dtype)
        for param, offset in zip(params, offsets):
            flat_param[offset:offset + param.numel()].copy_(param.detach().reshape(-1))
            param.data = flat_param[offset:offset + param.numel()].view_as(param)
        shard = layout.shard(flat_param, self.dp_rank)
        # fp32 parameters: the master IS this rank's (strided) share of them (the optimizer
        # updates the parameters in place); half parameters: an fp32 copy (Micikevicius et
        # al., 2018)
        master = torch.nn.Parameter(shard if dtype == torch.float32 and self._master_is_view(key)
                                    else shard.to(torch.float32, copy=True).contiguous())
        region = ShardRegion(params=params, offsets=offsets, layout=layout,
                             flat_param=flat_param, master=master,
                             pieces=cut_pieces(params, offsets, layout, self.dp_rank, master))
        self._attach_grads(key, region, grad_dtype)
        return region

    @staticmethod
    def _grad_dtype(param_dtype: torch.dtype) -> torch.dtype:
        """The dtype gradients are reduced and kept in: fp16 keeps fp16 gradients (Megatron's
        fp16 row: 2 + 2 + 16/d); bf16 and fp32 fp32."""
        return torch.float16 if param_dtype == torch.float16 else torch.float32

    def _master_is_view(self, key: int) -> bool:
        """Whether region `key`'s fp32 master may be a view of its parameters (ZeRO-3 frees
        them between uses, so its masters are copies)."""
        del key
        return True

    def _attach_grads(self, key: int, region: ShardRegion, grad_dtype: torch.dtype) -> None:
        """ZeRO-1: one whole main-gradient buffer, reduce-scattered at the last backward."""
        layout, params, offsets = region.layout, region.params, region.offsets
        last = layout.num_buckets - 1
        # the tail first: a backward makes the buffer's end final first
        region.grads = GradBuffer(params, offsets, layout.size, grad_dtype,
                                  [[layout.bucket(b)] for b in range(last, -1, -1)],
                                  lambda index: self._launch_bucket(region, last - index),
                                  hooked=key != TIED_REGION)
