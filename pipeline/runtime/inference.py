"""Inference beside training: `eval_batch` with its own microbatch count, outputs on every rank.

A training engine's forward-only schedule keeps its m. `Inference` runs forwards with any
m' instead: for each m' it builds (once) a second `PipelineEngine` over the same module,
process groups and stage placement, with a forward-only schedule of m' microbatches, so
no stage moves and no weight is copied. Its stream on every rank is microbatch-major:

    rank r: F(s, i) for i in 0..m'-1, for s in r's stages in ascending order

Every rank walks the same global order (i, s), and F(s, i) waits only for F(s-1, i), which
comes earlier in that order: no rank can wait on one that waits back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from pipeline.errors import PipelineConfigError
from pipeline.runtime.engine import PipelineEngine
from schedules import Instruction, Kind, Schedule, lower

__all__ = ["Inference", "forward_only_schedule"]


def forward_only_schedule(placement: tuple[int, ...], num_microbatches: int,
                          num_ranks: int) -> Schedule:
    """The lowered forward-only schedule of m microbatches over a stage placement."""
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or \
            num_microbatches < 1:
        raise PipelineConfigError(f"num_microbatches must be an int >= 1, got "
                                  f"{num_microbatches!r}")
    streams = tuple(
        tuple(Instruction(Kind.F, stage, i) for i in range(num_microbatches)
              for stage, rank in enumerate(placement) if rank == r)
        for r in range(num_ranks))
    return lower(Schedule(f"forward-only-m{num_microbatches}", num_microbatches,
                          tuple(placement), streams))


class Inference:
    """Forward passes for a trained (or training) `PipelineEngine`, with their own m."""

    def __init__(self, engine: PipelineEngine) -> None:
        if not isinstance(engine, PipelineEngine):
            raise TypeError(f"Inference needs a PipelineEngine, got {type(engine).__name__}")
        self.engine = engine
        self._engines: dict[int, PipelineEngine] = {}

    def _engine_for(self, num_microbatches: int | None) -> PipelineEngine:
        trained = self.engine
        if num_microbatches is None or num_microbatches == trained.num_microbatches:
            return trained
        if num_microbatches not in self._engines:
            trained.finish_param_gather()  # the new engine's set-up broadcasts parameters
            schedule = forward_only_schedule(trained.schedule.placement, num_microbatches,
                                             trained.schedule.num_ranks)
            self._engines[num_microbatches] = PipelineEngine(
                trained.module, schedule=schedule, topology=trained.topology,
                groups=trained.groups, device=trained.device,
                precision=trained.config.parallel.precision)
        return self._engines[num_microbatches]

    def eval_batch(self, inputs: Any = None, targets: Any = None, *,
                   num_microbatches: int | None = None, broadcast: bool = False,
                   data_iter: Iterator[Any] | None = None) -> Any:
        """Forward `inputs` in `num_microbatches` microbatches (default: the training m), or
        that many (inputs, targets) pairs from `data_iter`.

        Returns the last stage's outputs joined over microbatches: on the rank holding the
        last stage, and with `broadcast` on every rank of its pipeline (None elsewhere).
        With targets, the mean loss is in `last_loss`."""
        engine = self._engine_for(num_microbatches)
        outputs = engine.eval_batch(data_iter=data_iter) if data_iter is not None else \
            engine.eval_batch(inputs, targets)
        self.last_loss = engine.last_loss
        return self._broadcast(engine, outputs) if broadcast else outputs

    def eval_reduce(self, inputs: Any, reduce: Callable[[Any], Any], *,
                    num_microbatches: int | None = None) -> Any:
        """``reduce(outputs)`` of a forward of `inputs`, computed on the rank holding the last
        stage and sent to every rank of its pipeline: e.g. the next token of each row
        instead of the whole logits."""
        engine = self._engine_for(num_microbatches)
        outputs = engine.eval_batch(inputs)
        return self._broadcast(engine, None if outputs is None else reduce(outputs))

    @staticmethod
    def _broadcast(engine: PipelineEngine, value: Any) -> Any:
        """`value` of the rank holding the last stage, on every rank of the pipeline."""
        source = engine.position.pipeline_ranks[engine.schedule.placement[-1]]
        box = [value]
        group = engine.groups.pp_group if engine.groups is not None else None
        dist.broadcast_object_list(box, src=source, group=group)
        return box[0]

    last_loss: float | None = None
    """Mean loss of the last `eval_batch` given targets."""
