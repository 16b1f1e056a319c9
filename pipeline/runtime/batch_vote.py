"""The vote that opens every step: this rank's microbatches, checked, and agreed by every
pipeline rank (usable, same layout, inputs and targets of one size) before any instruction."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pipeline.errors import PipelineConfigError
from pipeline.runtime.batch import Layout, batch_size, split_microbatches, take_microbatches
from pipeline.runtime.comm import Comm

__all__ = ["AgreedBatch", "agree_on_batch"]


@dataclass(frozen=True)
class AgreedBatch:
    """What every rank agreed on, and this rank's part of the batch."""

    layout: int
    """A digest of the inputs' layouts (equal on every rank): a change means shape headers."""
    microbatches: list[Any] | None
    """This rank's input microbatches (first stage, or from a data iterator)."""
    targets: list[Any] | None
    """This rank's target microbatches (last stage)."""


def agree_on_batch(comm: Comm, pp_rank: int, m: int, inputs: Any, targets: Any,
                   data_iter: Iterator[tuple[Any, Any]] | None, *, training: bool,
                   first: bool, last: bool) -> AgreedBatch:
    """Split this rank's batch into `m` microbatches, then one all-reduce: every rank learns
    whether any refused its part, the layout digest, and both sample counts. Raises the
    same kind of error on every rank (its own problem, or the refusing ranks)."""
    problem: Exception | None = None
    microbatches = split_targets = None
    try:
        if data_iter is not None:
            microbatches, split_targets = take_microbatches(data_iter, m)
        else:
            if first:
                microbatches = split_microbatches(inputs, m, "inputs")
            if last and targets is not None:
                split_targets = split_microbatches(targets, m, "targets")
        if training and last and split_targets is None:
            raise PipelineConfigError("this rank holds the last stage: pass targets")
        if first and microbatches is None:
            raise PipelineConfigError("this rank holds the first stage: pass inputs")
    except (PipelineConfigError, TypeError) as error:
        problem = error
    local = samples = target_samples = 0
    if problem is None:
        if first and microbatches is not None:
            shapes = [Layout.of(x, "inputs") for x in microbatches]
            local = zlib.crc32(repr((shapes, training)).encode()) + 1
            samples = batch_size(microbatches)
        if last:
            target_samples = batch_size(split_targets)
    # also aligns the ranks' clocks: every rank leaves it within a message time
    (agreed, samples, target_samples), refused = comm.agree(
        [local, samples, target_samples], failed=problem is not None, pp_rank=pp_rank)
    if problem is not None:
        raise problem
    if refused:
        raise PipelineConfigError(f"pipeline rank(s) {refused} refused the batch (see "
                                  "their error); nothing was run")
    if samples and target_samples and samples != target_samples:
        # they would pair the wrong samples per microbatch, or broadcast into a wrong loss
        raise PipelineConfigError(f"inputs hold {samples} samples but targets "
                                  f"{target_samples}; pass one target per input sample "
                                  f"(same size in dim 0); nothing was run")
    return AgreedBatch(agreed, microbatches, split_targets)
