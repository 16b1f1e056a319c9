"""ZeRO-1 / 2 with expert parallelism: dense state sharded over dp, expert shards' state over
their expert-data-parallel group, one torch optimizer stepping both."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch.distributed import ProcessGroup

from pipeline.errors import PipelineConfigError
from pipeline.parallel.data_parallel import DEFAULT_BUCKET_MB
from pipeline.parallel.expert_reduction import split_expert_parameters
from pipeline.parallel.grad_buffer import GradBuffer
from pipeline.parallel.optimizer import OptimizerFactory, build_optimizer
from pipeline.parallel.param_gather import BucketKey
from pipeline.parallel.precision import clip_coefficient, global_grad_norm
from pipeline.parallel.zero import ShardedOptimizer
from pipeline.parallel.zero2 import GradShardedOptimizer
from pipeline.parallel.zero_collectives import Launched
from pipeline.parallel.zero_groups import carry_groups
from pipeline.parallel.zero_layout import ShardLayout

__all__ = ["ExpertGradShards", "ExpertShardedOptimizer", "placeholder_optimizer"]


class _ExpertShards(ShardedOptimizer):
    """ZeRO-1 of expert shards over the expert-dp group: each bucket averaged over its
    dp / ep ranks and divided by ep (why: `pipeline.parallel.expert_reduction`)."""

    def __init__(self, *args: object, ep: int, **kwargs: object) -> None:
        self.ep = ep
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def _launch_bucket(self, region: object, b: int) -> None:
        grad: torch.Tensor = region.flat_grad  # type: ignore[attr-defined]
        layout: ShardLayout = region.layout  # type: ignore[attr-defined]
        grad[slice(*layout.bucket(b))].div_(self.ep)
        super()._launch_bucket(region, b)  # type: ignore[arg-type]


class ExpertGradShards(GradShardedOptimizer):
    """ZeRO-2 of expert shards over the expert-dp group: each bucket of every backward
    averaged over its dp / ep ranks and divided by ep (as `_ExpertShards`)."""

    def __init__(self, *args: object, ep: int, **kwargs: object) -> None:
        self.ep = ep
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def _reduce_bucket(self, buffer: torch.Tensor, layout: ShardLayout) -> Launched:
        buffer.div_(self.ep)
        return super()._reduce_bucket(buffer, layout)


def placeholder_optimizer(params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
    """A half's own optimizer, never stepped: the joined one steps the user's one optimizer
    over both halves."""
    return torch.optim.SGD(list(params), lr=0.0)


class _GatherClock:
    """Seconds both halves blocked on their parameter all-gathers (the engine reads it)."""

    def __init__(self, *halves: ShardedOptimizer) -> None:
        self.halves = halves

    @property
    def wait_seconds(self) -> float:
        return sum(half.param_gather.wait_seconds for half in self.halves)


class ExpertShardedOptimizer(ShardedOptimizer):
    """Two `ShardedOptimizer`s, dense (over dp) and experts (over the expert-dp group),
    seen by the engine as one: reducer and optimizer. The inner optimizer is the user's one
    optimizer over every parameter, its groups carried onto both halves' shard pieces, so a
    learning-rate scheduler sees every parameter. Gradient clipping takes one norm over both
    halves; overlapped parameter gathers run per half; checkpoints read each half
    (`pipeline.checkpoint.zero_state`)."""

    def __init__(self, params_by_stage: Mapping[int, Sequence[torch.nn.Parameter]],
                 optimizer_factory: OptimizerFactory, dp_group: ProcessGroup,
                 expert_dp_group: ProcessGroup, ep: int, *,
                 bucket_mb: float = DEFAULT_BUCKET_MB,
                 overlap_param_gather: bool = False, zero_stage: int = 1) -> None:
        if zero_stage not in (1, 2):
            raise PipelineConfigError(f"ExpertShardedOptimizer runs ZeRO-1 or 2, got "
                                      f"zero_stage={zero_stage!r} (ZeRO-3: "
                                      f"ExpertFullyShardedOptimizer)")
        dense_class, expert_class = ((ShardedOptimizer, _ExpertShards) if zero_stage == 1
                                     else (GradShardedOptimizer, ExpertGradShards))
        dense: dict[int, list[torch.nn.Parameter]] = {}
        experts: dict[int, list[torch.nn.Parameter]] = {}
        for key, params in params_by_stage.items():
            dense[key], experts[key] = split_expert_parameters(params)
        self.join(dense_class(dense, placeholder_optimizer, dp_group, bucket_mb=bucket_mb,
                              overlap_param_gather=overlap_param_gather),
                  expert_class(experts, placeholder_optimizer, expert_dp_group, ep=ep,
                               bucket_mb=bucket_mb, overlap_param_gather=overlap_param_gather)
                  if any(experts.values()) else None,
                  optimizer_factory)

    def join(self, dense: ShardedOptimizer, experts: ShardedOptimizer | None,
             optimizer_factory: OptimizerFactory) -> None:
        """Become the two halves' one optimizer (both built with `placeholder_optimizer`)."""
        self.dense, self.experts = dense, experts
        self.halves = [h for h in (self.dense, self.experts) if h is not None]
        # the user's factory sees every parameter (dense and expert, as torch would); its
        # groups are carried onto both halves' shard pieces
        params = [p for half in self.halves for p in half.model_parameters()]
        optimizer = build_optimizer(optimizer_factory, params)
        carry_groups(optimizer, [piece for half in self.halves for piece in half.shard_pieces()],
                     params)
        for half in self.halves:
            half.share_surface(optimizer)
        self.share_surface(optimizer)
        self.group, self.dp_size, self.dp_rank = (self.dense.group, self.dense.dp_size,
                                                  self.dense.dp_rank)
        self.stats = self.dense.stats
        self.param_gather = _GatherClock(*self.halves)  # type: ignore[assignment]
        self._expert_ids = (set() if experts is None
                            else {id(p) for p in experts.model_parameters()})

    def _split(self, params: Sequence[torch.nn.Parameter]
               ) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
        return ([p for p in params if id(p) not in self._expert_ids],
                [p for p in params if id(p) in self._expert_ids])

    def reduce_stage(self, stage_index: int, params: Sequence[torch.nn.Parameter]) -> None:
        dense, experts = self._split(params)
        self.dense.reduce_stage(stage_index, dense)
        if self.experts is not None:
            self.experts.reduce_stage(stage_index, experts)

    def last_backward(self, stage_index: int) -> None:
        for half in self.halves:
            half.last_backward(stage_index)

    def backward_done(self, stage_index: int) -> None:
        """ZeRO-2: one B / W of the stage ended (each half launches its unfilled buckets)."""
        for half in self.halves:
            if isinstance(half, GradShardedOptimizer):
                half.backward_done(stage_index)

    def wait(self) -> None:
        for half in self.halves:
            half.wait()

    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for half in self.halves:
            half.wait()
            half.param_gather.wait()
        self.optimizer.step()
        for half in self.halves:
            half.publish()

    def finish_param_gather(self) -> None:
        for half in self.halves:
            half.finish_param_gather()

    def watch_forward(self, modules: Iterable[torch.nn.Module]) -> None:
        """With `overlap_param_gather`: each module's forward waits for its dense buckets
        (gathered over dp) and its expert buckets (over the expert-dp group), each half's
        own hooks."""
        modules = list(modules)
        for half in self.halves:
            half.watch_forward(modules)

    def buckets_of(self, param: torch.nn.Parameter) -> list[BucketKey]:
        """The buckets holding `param` in the half that holds it (keys are per half)."""
        half = self.experts if id(param) in self._expert_ids else self.dense
        return [] if half is None else half.buckets_of(param)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for half in self.halves:
            half.zero_grad(set_to_none)

    def grad_shards(self) -> list[torch.Tensor]:
        return [shard for half in self.halves for shard in half.grad_shards()]

    def gather_grads(self) -> dict[int, torch.Tensor]:
        """id(parameter) -> its reduced gradient (an expert shard's: this rank's experts)."""
        return {key: grad for half in self.halves for key, grad in half.gather_grads().items()}

    def clip_grad_norm_(self, max_norm: float, group: ProcessGroup | None, *,
                        tp_rank: int = 0) -> torch.Tensor:
        """Clip both halves' shards by one global norm; `group` spans every rank (the dense
        shards are disjoint over dp, the expert shards over the expert-dp group and the ep
        ranks hold different experts: no element is counted twice)."""
        self.wait()
        pieces = [piece for half in self.halves
                  for piece in half._norm_pieces(tp_rank)]
        total = global_grad_norm(pieces, group)
        coefficient = clip_coefficient(total, max_norm)
        for shard in self.grad_shards():
            shard.mul_(coefficient)
        return total

    def master_bytes(self) -> int:
        return sum(half.master_bytes() for half in self.halves)

    def gradient_buffer_bytes(self) -> int:
        return sum(half.gradient_buffer_bytes() for half in self.halves)

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        held: dict[str, list[torch.Tensor]] = {"parameters": [], "gradients": [],
                                               "masters": []}
        for half in self.halves:
            for kind, tensors in half.held_tensors().items():
                held[kind] += tensors
        return held

    def grad_buffers(self) -> list[GradBuffer]:
        return [buffer for half in self.halves for buffer in half.grad_buffers()]

    def layouts(self) -> dict[int, ShardLayout]:
        raise PipelineConfigError("an ExpertShardedOptimizer has two layouts, one per half: "
                                  "read .dense.layouts() and .experts.layouts()")
