"""ZeRO-1: optimizer state sharded over the data-parallel group (Rajbhandari et al., 2020).

Legend: d = data-parallel size, r = this rank's index in the dp group, N = a region's number
of elements, S = ceil(N / d) the shard size. A *region* is the set of parameters whose
gradients become final at the same moment: one pipeline stage's parameters (or, with tied
weights, the tied ones, which are final only after the owners' sum). Each region is flattened
into one buffer, padded to d · S, and rank r owns elements [r·S, (r+1)·S):

    flat buffer  | rank 0 shard | rank 1 shard | ... | rank d-1 shard (+ padding) |
    a bucket     |   [lo, hi)   |   [lo, hi)   | ... |   [lo, hi)                 |

A bucket is the same [lo, hi) slice of every shard, so a bucketed reduce-scatter hands rank r
exactly its own slice (the ZeRO paper's P_os, Megatron's distributed optimizer:
reduce-scatter gradients, step the shard in fp32, all-gather parameters; bytes per parameter
16 → 8 + 8/d with fp32 Adam state).

When reduction happens: with `last_backward(key)` called before a region's last backward
of the step, each bucket launches from the gradient hooks as soon as it is final, inside that
backward (`pipeline.parallel.grad_buffer`); `reduce_stage` (the engine's REDUCE_GRAD) then
launches what is left, without blocking, so it overlaps the rank's other stages; `step` first
(through `wait`) reduces any region nobody reduced yet, so the optimizer also works alone.
Buckets go from the shard's tail to its head: a bucket holds the same slice of all d shards,
so it is final once its slice of shard 0 is, i.e. after (d - 1)/d of the region's backward;
reductions hide behind the last 1/d of it (Megatron shards each bucket instead, a layout the
checkpoints here do not describe).
"""

from __future__ import annotations

import math
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
from pipeline.parallel.precision import clip_coefficient, counts_in_norm, global_grad_norm
from pipeline.parallel.tied_sync import TIED_REGION

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
    numel: int
    shard_size: int
    flat_param: torch.Tensor
    """The parameters laid end to end (their `.data` are views of it), padded to d · S."""
    master: torch.nn.Parameter
    """This rank's fp32 shard the inner optimizer steps: a view of `flat_param` when the
    parameters are fp32 (no second copy), an fp32 copy when they are bf16 / fp16."""
    buckets: list[tuple[int, int]]
    """[lo, hi) slices of a shard, in launch order (the buffer's tail, final first, first)."""
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
    steps fp32 master shards: views of the parameters when they are fp32.

    Bytes per parameter at the step, with Adam (Megatron's distributed-optimizer table):
    fp32 params 4 + main grads 4 + (moments 8)/d; bf16 params 2 + fp32 main grads 4 +
    (master 4 + moments 8)/d; fp16 params 2 + fp16 grads 2 + (fp32 grad 4 + master 4 +
    moments 8)/d.
    """

    def __init__(self, params_by_stage: Mapping[int, Sequence[torch.nn.Parameter]],
                 optimizer_factory: OptimizerFactory, group: ProcessGroup | None, *,
                 bucket_mb: float = DEFAULT_BUCKET_MB, average: bool = True,
                 collective: Collective = "auto") -> None:
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        if collective not in ("auto", "reduce_scatter", "reduce", "all_reduce", "all_to_all"):
            raise ValueError(f"collective must be 'auto', 'reduce_scatter', 'reduce', "
                             f"'all_reduce' or 'all_to_all', got {collective!r}")
        self.group = group
        self.dp_size = dist.get_world_size(group)
        self.dp_rank = dist.get_rank(group)
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.average = average
        if collective == "auto" and dist.get_backend(group) == "gloo":
            # gloo's reduce_scatter is a full all-reduce underneath: measured on torch 2.13,
            # each rank sends N bytes for an N-byte buffer instead of the ring's (d-1)/d · N.
            # Exchanging the pieces with all_to_all and summing locally sends (d-1)/d · N, but
            # holds a copy of the pieces and a d-piece receive buffer per bucket in flight (up
            # to 2 · N when the whole buffer is). collective="reduce" (one in-place reduce per
            # shard) allocates nothing but sends 1.4-1.6x the bytes (bench_3d, d = 2).
            collective = "all_to_all"
        if collective == "auto":
            collective = "reduce_scatter" if detect_reduce_scatter(group) else "all_reduce"
            if collective == "all_reduce":
                warnings.warn(f"backend {dist.get_backend(group)!r} has no reduce_scatter here; "
                              f"ZeRO-1 falls back to all_reduce + slice (same result, "
                              f"{self.dp_size}x the gradient traffic)", stacklevel=2)
        self.collective: Literal["reduce_scatter", "reduce", "all_reduce", "all_to_all"] = \
            collective
        """Which collective reduces gradients: reduce_scatter; one in-place reduce per shard
        to its owner (gloo: no buffer); all_to_all of the pieces + a local sum; or all_reduce
        + slice where the backend lacks reduce_scatter (d× the received bytes, same
        result)."""
        self.stats = CommStats()
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
            shard = self._shard_view(region)
            region.master.grad = shard if shard.dtype == torch.float32 else shard.float()

    # -- the optimizer role -----------------------------------------------------------------

    def step(self) -> None:
        """Reduce what is not reduced yet, step the shard, all-gather updated parameters."""
        self.wait()
        self.optimizer.step()
        self._gather_params()
        for region in self._regions.values():
            region.reduced = False

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
        """This rank's reduced fp32 gradient shards (valid after `wait`): overflow checks,
        unscaling and clipping act on these, and the optimizer steps with them."""
        return [self._step_grad(region) for region in self._regions.values()]

    def gather_grads(self) -> dict[int, torch.Tensor]:
        """id(parameter) -> its full reduced gradient, all-gathered from every dp rank's shard
        (collective over the group). Read after `wait` or `step` (clipped and unscaled as the
        step saw it). For checks and debugging: it materialises what ZeRO-1 avoids holding."""
        full: dict[int, torch.Tensor] = {}
        for region in self._regions.values():
            shard = self._step_grad(region)
            parts = [torch.empty_like(shard) for _ in range(self.dp_size)]
            dist.all_gather(parts, shard.clone(), group=self.group)
            flat = torch.cat(parts)
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
        shard_size = math.ceil(numel / self.dp_size)
        flat_param = torch.zeros(shard_size * self.dp_size, dtype=dtype)
        for param, offset in zip(params, offsets):
            flat_param[offset:offset + param.numel()].copy_(param.detach().reshape(-1))
            param.data = flat_param[offset:offset + param.numel()].view_as(param)
        start = self.dp_rank * shard_size
        shard = flat_param[start:start + shard_size]
        # fp32 parameters: the master IS this rank's slice of them (the optimizer updates the
        # parameters in place); half parameters: an fp32 copy (Micikevicius et al., 2018)
        master = torch.nn.Parameter(shard if dtype == torch.float32
                                    else shard.to(torch.float32, copy=True))
        region = _Region(params=params, offsets=offsets, numel=numel, shard_size=shard_size,
                         flat_param=flat_param, master=master, buckets=[])
        # fp16 keeps fp16 gradients (Megatron's fp16 row: 2 + 2 + 16/d); bf16 and fp32 fp32
        grad_dtype = torch.float16 if dtype == torch.float16 else torch.float32
        per_rank = max(1, self.bucket_bytes // (grad_dtype.itemsize * self.dp_size))
        # the shard's tail first: a backward makes the buffer's end final first
        region.buckets = [(lo, min(lo + per_rank, shard_size))
                          for lo in reversed(range(0, shard_size, per_rank))]
        region.grads = GradBuffer(params, offsets, flat_param.numel(), grad_dtype,
                                  [self._bucket_slices(region, lo, hi)
                                   for lo, hi in region.buckets],
                                  lambda b: self._launch_bucket(region, b),
                                  hooked=key != TIED_REGION)
        return region

    def _bucket_slices(self, region: _Region, lo: int, hi: int) -> list[tuple[int, int]]:
        """The [start, end) slices of the flat buffer one bucket's collective reduces."""
        size = region.shard_size
        if self.collective == "all_reduce":
            return [(lo * self.dp_size, hi * self.dp_size)]
        return [(r * size + lo, r * size + hi) for r in range(self.dp_size)]

    def _shard_view(self, region: _Region) -> torch.Tensor:
        start = self.dp_rank * region.shard_size
        return region.flat_grad[start:start + region.shard_size]

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

    def _launch_bucket(self, region: _Region, index: int) -> None:
        lo, hi = region.buckets[index]
        if self.average:
            # Divide before summing, as DDP does, so fp16 sums stay in range.
            for start, end in self._bucket_slices(region, lo, hi):
                region.flat_grad[start:end].div_(self.dp_size)
        if self.collective == "reduce":
            region.pending += self._reduce_each(region, lo, hi)
            return
        launch = {"reduce_scatter": self._reduce_scatter, "all_to_all": self._exchange,
                  "all_reduce": self._all_reduce}[self.collective]
        region.pending.append(launch(region, lo, hi))

    # One bucket [lo, hi) of every rank's shard, three ways; each returns the work and what
    # to do when it has arrived.

    def _reduce_scatter(self, region: _Region, lo: int, hi: int
                        ) -> tuple[dist.Work, _Finish | None]:
        size = region.shard_size
        pieces = [region.flat_grad[r * size + lo:r * size + hi] for r in range(self.dp_size)]
        self.stats.record("reduce_scatter", *pieces)
        received = torch.empty_like(pieces[0])  # the output must not alias an input piece
        work = dist.reduce_scatter(received, pieces, group=self.group, async_op=True)

        def finish() -> None:
            self._shard_view(region)[lo:hi].copy_(received)
        return _require(work), finish

    def _reduce_each(self, region: _Region, lo: int, hi: int
                     ) -> list[tuple[dist.Work, _Finish | None]]:
        """Sum each rank's piece into its owner, in place: no buffer; the other ranks' pieces
        of this rank's buffer are left as scratch (only the own shard is read after)."""
        works: list[tuple[dist.Work, _Finish | None]] = []
        for owner, (start, end) in enumerate(self._bucket_slices(region, lo, hi)):
            piece = region.flat_grad[start:end]
            self.stats.record("reduce", piece)
            dst = owner if self.group is None else dist.get_global_rank(self.group, owner)
            works.append((_require(dist.reduce(piece, dst, group=self.group,
                                               async_op=True)), None))
        return works

    def _exchange(self, region: _Region, lo: int, hi: int) -> tuple[dist.Work, _Finish | None]:
        """Send rank r the bucket of its shard, receive the other ranks' bucket of ours, add
        them to our own piece in place."""
        d, me = self.dp_size, self.dp_rank
        rows = region.flat_grad.view(d, region.shard_size)[:, lo:hi]
        # Our own piece need not travel: sent to ourselves it would cost a piece in the
        # receive buffer (a whole region's worth for d = 2 and one bucket). Without it the
        # rest must be one tensor in rank order: a view when ours is the first or last row
        # of contiguous rows; a copy of the others where the rows are copied anyway.
        if d == 1 or (rows.is_contiguous() and 0 < me < d - 1):
            pieces = rows  # ours alone or in the middle: sent to ourselves, summed with all
        elif rows.is_contiguous():
            pieces = rows[1:] if me == 0 else rows[:-1]
        else:
            pieces = rows[[r for r in range(d) if r != me]]
        splits = [1] * d  # rows of `pieces`, one per rank
        if pieces.shape[0] < d:
            splits[me] = 0
        received = torch.empty_like(pieces)
        self.stats.record("all_to_all", pieces)
        work = dist.all_to_all_single(received, pieces, output_split_sizes=splits,
                                      input_split_sizes=splits, group=self.group,
                                      async_op=True)

        def finish() -> None:
            shard = self._shard_view(region)[lo:hi]
            if received.shape[0] == d:  # ours came back among them
                torch.sum(received, dim=0, out=shard)
                return
            for piece in received:
                shard.add_(piece)
        return _require(work), finish

    def _all_reduce(self, region: _Region, lo: int, hi: int) -> tuple[dist.Work, _Finish | None]:
        # Fallback: reduce the same amount of the buffer, contiguously; this rank's shard of
        # the fully reduced buffer is then in place.
        chunk = region.flat_grad[lo * self.dp_size:hi * self.dp_size]
        self.stats.record("all_reduce", chunk)
        return _require(dist.all_reduce(chunk, group=self.group, async_op=True)), None

    def _gather_params(self) -> None:
        works = []
        for region in self._regions.values():
            size, start = region.shard_size, self.dp_rank * region.shard_size
            if not _aliases(region.master, region.flat_param):
                region.flat_param[start:start + size].copy_(region.master.detach())
            if self.dp_size == 1:
                continue
            for lo, hi in region.buckets:
                outputs = [region.flat_param[r * size + lo:r * size + hi]
                           for r in range(self.dp_size)]
                mine = outputs[self.dp_rank].clone()  # input must not alias an output
                self.stats.record("all_gather", mine)
                works.append(_require(dist.all_gather(outputs, mine, group=self.group,
                                                      async_op=True)))
        for work in works:
            work.wait()

    def _norm_pieces(self, tp_rank: int) -> Iterable[torch.Tensor]:
        """Slices of the grad shards that belong to parameters counted in the norm."""
        for region in self._regions.values():
            start = self.dp_rank * region.shard_size
            end = start + region.shard_size
            shard = self._step_grad(region)
            for param, offset in zip(region.params, region.offsets):
                lo, hi = max(offset, start), min(offset + param.numel(), end)
                if lo < hi and counts_in_norm(param, tp_rank):
                    yield shard[lo - start:hi - start]


def _aliases(view: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether `view` shares `base`'s memory (a view of it, not a copy)."""
    return view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


def _require(work: dist.Work | None) -> dist.Work:
    if work is None:
        raise RuntimeError("an async_op=True collective returned no work handle")
    return work
