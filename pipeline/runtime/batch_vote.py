"""The vote that opens every step: this rank's microbatches, checked, and agreed by every
pipeline rank (usable, same layout, inputs and targets of one size) before any instruction."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pipeline.errors import PipelineConfigError
from pipeline.runtime.batch import Layout, batch_size, split_microbatches
from pipeline.runtime.comm import Comm
from pipeline.runtime.pulled_batch import PulledHalf, PulledMicrobatches

__all__ = ["AgreedBatch", "agree_on_batch"]


@dataclass(frozen=True)
class AgreedBatch:
    """What every rank agreed on, and this rank's part of the batch."""

    layout: int
    """A digest of the inputs' layouts (equal on every rank): a change means shape headers."""
    microbatches: list[Any] | PulledHalf | None
    """This rank's input microbatches (first stage): split from its inputs, or pulled from
    its data iterator as each is loaded."""
    targets: list[Any] | PulledHalf | None
    """This rank's target microbatches (last stage), the same ways."""


def agree_on_batch(comm: Comm, pp_rank: int, m: int, inputs: Any, targets: Any,
                   data_iter: Iterator[tuple[Any, Any]] | None, *, training: bool,
                   first: bool, last: bool, varying: bool = False,
                   refusal: Exception | None = None) -> AgreedBatch:
    """Split this rank's batch into `m` microbatches (or, from `data_iter`, pull the first
    of m pairs: the rest are pulled as the step loads them, `PulledMicrobatches`; a rank
    holding neither the first nor the last stage pulls none), then one all-reduce: every
    rank learns whether any refused its part, the layout digest, and both sample counts.
    Raises the same kind of error on every rank (its own problem, or the refusing ranks).
    `varying`: pulled microbatches may change layout (every message carries a header);
    `refusal`: a problem this rank found before the batch, refused the same way."""
    problem: Exception | None = refusal
    split: list[Any] | None = None
    split_targets: list[Any] | None = None
    pulled: PulledMicrobatches | None = None
    try:
        if problem is not None:
            raise problem
        if data_iter is not None:
            if first or last:
                pulled = PulledMicrobatches(data_iter, m, keep_inputs=first,
                                            keep_targets=last, varying=varying)
        else:
            if first:
                split = split_microbatches(inputs, m, "inputs")
            if last and targets is not None:
                split_targets = split_microbatches(targets, m, "targets")
            if training and last and split_targets is None:
                raise PipelineConfigError("this rank holds the last stage: pass targets")
            if first and split is None:
                raise PipelineConfigError("this rank holds the first stage: pass inputs")
    except (PipelineConfigError, TypeError) as error:
        problem = error
    local = samples = target_samples = 0
    if problem is None and pulled is not None:
        # every later pair has pair 0's layout (else refused when pulled): the digest of m
        # equal microbatches, as their split batch would give
        if first:
            local = zlib.crc32(repr(([pulled.layout] * m, training)).encode()) + 1
            samples = pulled.samples * m
        if last:
            target_samples = pulled.target_samples * m
    elif problem is None:
        if first and split is not None:
            shapes = [Layout.of(x, "inputs") for x in split]
            local = zlib.crc32(repr((shapes, training)).encode()) + 1
            samples = batch_size(split)
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
        mismatch = PipelineConfigError(
            f"inputs hold {samples} samples but targets {target_samples}; pass one target "
            f"per input sample (same size in dim 0); nothing was run")
        # every rank raises this; the launcher names the rank whose data it is (the first
        # stage's, pipeline rank 0), not whichever rank reported first (a middle one)
        mismatch.caused_by = comm.pipeline_ranks[0]  # type: ignore[attr-defined]
        raise mismatch
    if pulled is not None:
        return AgreedBatch(agreed, pulled.inputs if first else None,
                           pulled.targets if last else None)
    return AgreedBatch(agreed, split, split_targets)
