"""Microbatches pulled from a DeepSpeed-style data iterator one at a time, as a step loads them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pipeline.errors import PipelineConfigError
from pipeline.runtime.batch import Layout, batch_size, describe

__all__ = ["PulledHalf", "PulledMicrobatches"]


class PulledMicrobatches:
    """This rank's m (inputs, targets) pairs of one step, pulled from `data_iter` in order
    when the step first reads one (its LOAD), as DeepSpeed's ``LoadMicroBatch`` does: only
    the microbatches in flight are alive, never the step's whole batch.

    Pair 0 is pulled on construction (the step's vote agrees on its layout before any
    instruction runs). Each half is read once, through `inputs` / `targets`: reading hands it
    over and forgets it; a half this rank never reads (inputs off the first stage, targets
    off the last) is dropped as its pair is pulled. A later pair whose inputs are laid out
    otherwise than pair 0's is refused when it is pulled (its receivers expect the agreed
    layout), unless `varying` (the engine's ``dynamic_shapes``: every message carries its
    shape header); a pair whose inputs and targets count different samples always is.
    """

    def __init__(self, data_iter: Iterator[Any], num_microbatches: int, *,
                 keep_inputs: bool, keep_targets: bool, varying: bool) -> None:
        self.num_microbatches = num_microbatches
        self._iter = data_iter
        self._keep = (keep_inputs, keep_targets)
        self._varying = varying
        self._halves: tuple[dict[int, Any], dict[int, Any]] = ({}, {})
        self.pulled = 0
        """Pairs taken from the iterator so far this step."""
        self.layout: Layout | None = None
        """Pair 0's input layout (set by the first pull)."""
        self.samples = self.target_samples = 0
        """Pair 0's input and target samples (0 when the targets are not countable)."""
        self._pull()
        self.inputs = PulledHalf(self, 0, "inputs")
        """Input microbatch i, pulled when first read (first stage)."""
        self.targets = PulledHalf(self, 1, "targets")
        """Target microbatch i, pulled when first read (last stage)."""

    def take(self, half: int, index: int, what: str) -> Any:
        """Half `half` (0 inputs, 1 targets) of pair `index`, pulling up to it; once."""
        if not 0 <= index < self.num_microbatches:
            raise IndexError(f"microbatch {index} of {self.num_microbatches}")
        while self.pulled <= index:
            self._pull()
        try:
            return self._halves[half].pop(index)
        except KeyError:
            raise RuntimeError(f"internal error: the {what} of microbatch {index} were read "
                               f"twice, or on a rank that does not keep them") from None

    def _pull(self) -> None:
        k, m = self.pulled, self.num_microbatches
        try:
            pair = next(self._iter)
        except StopIteration:
            raise PipelineConfigError(f"data_iter ran out after {k} of num_microbatches={m} "
                                      f"microbatches; yield m (inputs, targets) pairs per "
                                      f"step") from None
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise TypeError(f"data_iter must yield (inputs, targets) pairs, got "
                            f"{describe(pair)} as microbatch {k}")
        layout = Layout.of(pair[0], f"the inputs of microbatch {k}")
        samples, target_samples = batch_size([pair[0]]), batch_size([pair[1]])
        if samples and target_samples and samples != target_samples:
            raise PipelineConfigError(
                f"microbatch {k} from data_iter has {samples} input samples but "
                f"{target_samples} target samples; yield one target per input sample (same "
                f"size in dim 0)")
        if k == 0:
            self.layout, self.samples, self.target_samples = layout, samples, target_samples
        elif layout != self.layout and not self._varying:
            raise PipelineConfigError(
                f"microbatch {k} from data_iter has inputs {_shapes(layout)}, microbatch 0 "
                f"{_shapes(self.layout)}: microbatches are pulled one at a time, so the step "
                f"agreed on microbatch 0's layout; yield equal microbatches, or build the "
                f"engine with dynamic_shapes=True (a shape header with every message)")
        self.pulled += 1
        for keep, halves, value in zip(self._keep, self._halves, pair):
            if keep:
                halves[k] = value


class PulledHalf:
    """The inputs or the targets of a `PulledMicrobatches`, indexed by microbatch; reading
    microbatch i pulls the pairs up to i and hands its half over (read each once)."""

    def __init__(self, source: PulledMicrobatches, half: int, what: str) -> None:
        self._source, self._half, self._what = source, half, what

    def __getitem__(self, index: int) -> Any:
        return self._source.take(self._half, index, self._what)

    def __len__(self) -> int:
        return self._source.num_microbatches


def _shapes(layout: Layout | None) -> str:
    if layout is None:
        return "unknown"
    return ", ".join(f"{list(shape)} {str(dtype).removeprefix('torch.')}"
                     for shape, dtype in layout.tensors)
