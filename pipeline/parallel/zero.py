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
also works alone. The parameter all-gather after the step is `pipeline.parallel.param_gather`:
blocking, or (`overlap_param_gather`) left in flight for the next forward to wait for.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from pipeline.parallel.data_parallel import DEFAULT_BUCKET_MB, CommStats
from pipeline.parallel.grad_buffer import GradBuffer
from pipeline.parallel.optimizer import OptimizerFactory, build_optimizer
from pipeline.parallel.param_gather import BucketKey, ParamGather
from pipeline.parallel.precision import clip_coefficient, counts_in_norm, global_grad_norm
from pipeline.parallel.tied_sync import TIED_REGION
from pipeline.parallel.zero_layout import ShardLayout

__all__ = ["Collective", "ShardedOptimizer", "detect_reduce_scatter"]

Collective = Literal["auto", "reduce_scatter", "reduce", "all_reduce", "all_to_all"]
_Finish = Callable[[], None]
"""Completes one pending collective's bookkeeping once its work handle is waited."""


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


@dataclass
class _Region:
    params: list[torch.nn.Parameter]
    offsets: list[int]
    layout: ShardLayout
    flat_param: torch.Tensor
    """The parameters laid end to end (their `.data` are views of it), padded to k·d·s."""
    master: torch.nn.Parameter
    """This rank's fp32 shard, (k, s), the inner optimizer steps: a strided view of
    `flat_param` when the parameters are fp32 (no second copy), an fp32 copy when they are
    bf16 / fp16."""
    grads: GradBuffer | None = None
    pending: list[tuple[dist.Work, _Finish | None]] = field(default_factory=list)
    """Launched bucket reductions, each with what to do once it arrived (all_to_all: sum)."""
    reduced: bool = False

    @property
    def flat_grad(self) -> torch.Tensor:
        if self.grads is None:
            raise RuntimeError("internal error: a ZeRO region without its gradient buffer")
        return self.grads.flat


class ShardedOptimizer:
    """A torch optimizer whose state lives only on this rank's 1/d shard of the parameters.

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
        if collective not in ("auto", "reduce_scatter", "reduce", "all_reduce", "all_to_all"):
            raise ValueError(f"collective must be 'auto', 'reduce_scatter', 'reduce', "
                             f"'all_reduce' or 'all_to_all', got {collective!r}")
        if not isinstance(overlap_param_gather, bool):
            raise TypeError(f"overlap_param_gather must be True or False, got "
                            f"{overlap_param_gather!r}")
        self.group = group
        self.dp_size = dist.get_world_size(group)
        self.dp_rank = dist.get_rank(group)
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.average = average
        if collective == "auto" and dist.get_backend(group) == "gloo":
            # gloo's reduce_scatter is a full all-reduce underneath: measured on torch 2.13,
            # each rank sends N bytes for an N-byte buffer instead of the ring's (d-1)/d · N.
            # Exchanging the pieces with all_to_all and summing locally sends (d-1)/d · N, but
            # holds a d-piece receive buffer per bucket in flight (up to N when the whole
            # buffer is). collective="reduce" (one in-place reduce per piece) allocates
            # nothing but sends 1.4-1.6x the bytes (bench_3d, d = 2).
            collective = "all_to_all"
        if collective == "auto":
            collective = "reduce_scatter" if detect_reduce_scatter(group) else "all_reduce"
            if collective == "all_reduce":
                warnings.warn(f"backend {dist.get_backend(group)!r} has no reduce_scatter here; "
                              f"ZeRO-1 falls back to all_reduce + slice (same result, "
                              f"{self.dp_size}x the gradient traffic)", stacklevel=2)
        self.collective: Literal["reduce_scatter", "reduce", "all_reduce", "all_to_all"] = \
            collective
        """Which collective reduces gradients: reduce_scatter; one in-place reduce per piece
        to its owner (gloo: no buffer); all_to_all of the pieces + a local sum; or all_reduce
        + slice where the backend lacks reduce_scatter (d× the received bytes, same
        result)."""
        self.stats = CommStats()
        self.param_gather = ParamGather(group, self.dp_rank, self.stats,
                                        overlap=overlap_param_gather)
        """The all-gather of updated parameters after `step` (blocking or overlapped)."""
        self._regions: dict[int, _Region] = {}
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
        self.optimizer = build_optimizer(optimizer_factory,
                                         [region.master for region in self._regions.values()])

    # -- the reducer role -------------------------------------------------------------------

    def reduce_stage(self, stage_index: int, params: Sequence[torch.nn.Parameter]) -> None:
        """Launch the reduce-scatter of one region's gradients without waiting (the buckets
        its last backward did not launch already)."""
        region = self._regions.get(stage_index)
        trainable = {id(p) for p in params if p.requires_grad}
        if region is None:
            if trainable:
                raise KeyError(f"stage {stage_index} has no ZeRO region; regions are "
                               f"{sorted(self._regions)} (pass its parameters to "
                               f"ShardedOptimizer's params_by_stage)")
            return
        if trainable != {id(p) for p in region.params}:
            raise ValueError(
                f"reduce_stage({stage_index}) got {len(trainable)} trainable parameters but "
                f"the region holds {len(region.params)} different ones; pass the same "
                f"parameters as in params_by_stage[{stage_index}]")
        if region.reduced:
            raise RuntimeError(f"stage {stage_index} was reduced twice in one step; call "
                               f"step() (or zero_grad()) between steps")
        self._launch_reduce(region)

    def last_backward(self, stage_index: int) -> None:
        """The next backward of this stage is its last of the step: launch each bucket's
        reduction from the gradient hooks as soon as the bucket is final (overlap)."""
        region = self._regions.get(stage_index)
        if region is not None and region.grads is not None and region.grads.hooked \
                and not region.reduced:
            region.grads.arm()

    def wait(self) -> None:
        """Reduce every region not reduced yet, then block until all reductions finished;
        the shards then hold reduced gradients (the masters' `.grad`)."""
        for region in self._regions.values():
            if not region.reduced:
                self._launch_reduce(region)
        for region in self._regions.values():
            if not region.pending:
                continue  # finished by an earlier wait; the shard may be clipped since
            for work, finish in region.pending:
                work.wait()
                if finish is not None:
                    finish()
            region.pending.clear()
            shard = region.layout.shard(region.flat_grad, self.dp_rank)
            region.master.grad = shard if shard.dtype == torch.float32 else shard.float()

    # -- the optimizer role -----------------------------------------------------------------

    def step(self) -> None:
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
            if not _aliases(region.master, region.flat_param):
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

    def buckets_of(self, param: torch.nn.Parameter) -> list[BucketKey]:
        """The (region key, bucket index) pairs holding `param`'s elements."""
        return list(self._buckets_of.get(id(param), []))

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
            region.reduced = False

    def grad_shards(self) -> list[torch.Tensor]:
        """This rank's reduced fp32 gradient shards, (k, s) each (valid after `wait`):
        overflow checks, unscaling and clipping act on these, and the optimizer steps with
        them."""
        return [self._step_grad(region) for region in self._regions.values()]

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

    def clip_grad_norm_(self, max_norm: float, group: ProcessGroup | None, *,
                        tp_rank: int = 0) -> torch.Tensor:
        """Clip the reduced shards by the global norm; `group` must span every rank holding
        a shard (the world: dp shards × pp stages × tp ranks). Returns the total norm."""
        self.wait()
        pieces = list(self._norm_pieces(tp_rank))
        total = global_grad_norm(pieces, group)
        coefficient = clip_coefficient(total, max_norm)
        for shard in self.grad_shards():
            shard.mul_(coefficient)
        return total

    def state_bytes(self) -> int:
        """Bytes of the optimizer-state tensors (moments etc.) held by this rank."""
        return sum(value.numel() * value.element_size()
                   for state in self.optimizer.state.values()
                   for value in state.values() if isinstance(value, torch.Tensor))

    def master_bytes(self) -> int:
        """Bytes of the fp32 master shards held apart from the parameters (0 when the
        parameters are fp32: each master is then a view of them)."""
        return sum(r.master.numel() * r.master.element_size() for r in self._regions.values()
                   if not _aliases(r.master, r.flat_param))

    def gradient_buffer_bytes(self) -> int:
        """Bytes of the gradient buffers: each region's main-gradient buffer, and the fp32
        copies of this rank's shard where the buffer is not fp32 (fp16, after `wait`)."""
        return sum(r.flat_grad.numel() * r.flat_grad.element_size()
                   + sum(g.numel() * g.element_size() for g in [r.master.grad]
                         if g is not None and not _aliases(g, r.flat_grad))
                   for r in self._regions.values())

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this object keeps beyond the inner optimizer's state, by kind:
        'parameters' (flat buffers), 'gradients' (main-gradient buffers, shard gradients),
        'masters' (for counting live bytes; views share their base's storage)."""
        held: dict[str, list[torch.Tensor]] = {"parameters": [], "gradients": [],
                                               "masters": []}
        for region in self._regions.values():
            held["parameters"].append(region.flat_param)
            held["gradients"].append(region.flat_grad)
            if region.master.grad is not None:
                held["gradients"].append(region.master.grad)
            held["masters"].append(region.master)
        return held

    def layouts(self) -> dict[int, ShardLayout]:
        """Region key -> where its buckets and this group's shards lie in its flat buffer."""
        return {key: region.layout for key, region in self._regions.items()}

    # -- internals --------------------------------------------------------------------------

    def _build_region(self, key: int, params: list[torch.nn.Parameter]) -> _Region:
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise TypeError(f"stage {key}'s parameters mix dtypes {sorted(map(str, dtypes))}; "
                            f"a ZeRO region is one flat buffer, cast the stage to one dtype")
        dtype = params[0].dtype
        offsets, numel = [], 0
        for param in params:
            offsets.append(numel)
            numel += param.numel()
        # fp16 keeps fp16 gradients (Megatron's fp16 row: 2 + 2 + 16/d); bf16 and fp32 fp32
        grad_dtype = torch.float16 if dtype == torch.float16 else torch.float32
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
        master = torch.nn.Parameter(shard if dtype == torch.float32
                                    else shard.to(torch.float32, copy=True).contiguous())
        region = _Region(params=params, offsets=offsets, layout=layout, flat_param=flat_param,
                         master=master)
        last = layout.num_buckets - 1
        # the tail first: a backward makes the buffer's end final first
        region.grads = GradBuffer(params, offsets, layout.size, grad_dtype,
                                  [[layout.bucket(b)] for b in range(last, -1, -1)],
                                  lambda index: self._launch_bucket(region, last - index),
                                  hooked=key != TIED_REGION)
        return region

    def _step_grad(self, region: _Region) -> torch.Tensor:
        grad = region.master.grad
        if grad is None:
            raise RuntimeError("the gradient shards are read before wait(): call wait() (or "
                               "clip_grad_norm_ / step) first")
        return grad

    def _launch_reduce(self, region: _Region) -> None:
        if region.grads is None:
            raise RuntimeError("internal error: a ZeRO region without its gradient buffer")
        # unhooked (tied) gradients, or ones accumulated before this optimizer existed
        region.grads.take_grads()
        region.grads.flush()
        region.reduced = True

    def _launch_bucket(self, region: _Region, b: int) -> None:
        if self.average:
            # Divide before summing, as DDP does, so fp16 sums stay in range.
            region.flat_grad[slice(*region.layout.bucket(b))].div_(self.dp_size)
        if self.collective == "reduce":
            region.pending += self._reduce_each(region, b)
            return
        launch = {"reduce_scatter": self._reduce_scatter, "all_to_all": self._exchange,
                  "all_reduce": self._all_reduce}[self.collective]
        region.pending.append(launch(region, b))

    # One bucket b (d pieces of s elements, piece q owned by rank q), four ways; each returns
    # the work and what to do when it has arrived.

    def _own_piece(self, region: _Region, b: int) -> torch.Tensor:
        return region.flat_grad[slice(*region.layout.owned(b, self.dp_rank))]

    def _reduce_scatter(self, region: _Region, b: int) -> tuple[dist.Work, _Finish | None]:
        layout = region.layout
        pieces = [region.flat_grad[slice(*layout.owned(b, q))] for q in range(self.dp_size)]
        self.stats.record("reduce_scatter", *pieces)
        received = torch.empty_like(pieces[0])  # the output must not alias an input piece
        work = dist.reduce_scatter(received, pieces, group=self.group, async_op=True)

        def finish() -> None:
            self._own_piece(region, b).copy_(received)
        return _require(work), finish

    def _reduce_each(self, region: _Region, b: int) -> list[tuple[dist.Work, _Finish | None]]:
        """Sum each rank's piece into its owner, in place: no buffer; the other ranks' pieces
        of this rank's buffer are left as scratch (only the own shard is read after)."""
        works: list[tuple[dist.Work, _Finish | None]] = []
        for owner in range(self.dp_size):
            piece = region.flat_grad[slice(*region.layout.owned(b, owner))]
            self.stats.record("reduce", piece)
            dst = owner if self.group is None else dist.get_global_rank(self.group, owner)
            works.append((_require(dist.reduce(piece, dst, group=self.group,
                                               async_op=True)), None))
        return works

    def _exchange(self, region: _Region, b: int) -> tuple[dist.Work, _Finish | None]:
        """Send rank q the piece of bucket b it owns, receive the other ranks' copies of ours,
        add them to our own piece in place."""
        d, me = self.dp_size, self.dp_rank
        layout = region.layout
        rows = region.flat_grad[slice(*layout.bucket(b))].view(d, layout.piece)
        # Our own piece need not travel: sent to ourselves it would cost a piece in the
        # receive buffer (half the bucket for d = 2). Without it the rest must be one tensor
        # in rank order: a view when ours is the first or last row; a rank in the middle
        # sends all rows (ours to itself) and sums them.
        if d == 1 or 0 < me < d - 1:
            pieces = rows
        else:
            pieces = rows[1:] if me == 0 else rows[:-1]
        splits = [1] * d  # rows of `pieces`, one per rank
        if pieces.shape[0] < d:
            splits[me] = 0
        received = torch.empty_like(pieces)
        self.stats.record("all_to_all", pieces)
        work = dist.all_to_all_single(received, pieces, output_split_sizes=splits,
                                      input_split_sizes=splits, group=self.group,
                                      async_op=True)

        def finish() -> None:
            shard = self._own_piece(region, b)
            if received.shape[0] == d:  # ours came back among them
                torch.sum(received, dim=0, out=shard)
                return
            for piece in received:
                shard.add_(piece)
        return _require(work), finish

    def _all_reduce(self, region: _Region, b: int) -> tuple[dist.Work, _Finish | None]:
        # Fallback: reduce the whole bucket; this rank's piece of it is then in place.
        bucket = region.flat_grad[slice(*region.layout.bucket(b))]
        self.stats.record("all_reduce", bucket)
        return _require(dist.all_reduce(bucket, group=self.group, async_op=True)), None

    def _norm_pieces(self, tp_rank: int) -> Iterable[torch.Tensor]:
        """Slices of the grad shards that belong to parameters counted in the norm."""
        for region in self._regions.values():
            shard = self._step_grad(region)
            for param, offset in zip(region.params, region.offsets):
                if not counts_in_norm(param, tp_rank):
                    continue
                for b, _, row in region.layout.overlaps(offset, param.numel(), self.dp_rank):
                    yield shard[b, row]


def _aliases(view: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether `view` shares `base`'s memory (a view of it, not a copy)."""
    return view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


def _require(work: dist.Work | None) -> dist.Work:
    if work is None:
        raise RuntimeError("an async_op=True collective returned no work handle")
    return work
