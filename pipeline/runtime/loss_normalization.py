"""Loss normalisation that equals the single-process model: weight by tokens, not microbatches.

The engine's default makes the loss the mean of the m microbatch means (and of the dp
replicas' means). That equals the full-batch mean only when every microbatch counts the
same number of items; with padding (labels = ignore_index) it does not: a microbatch of 3
real tokens weighs as much as one of 300. A loss that declares ``reduction = "sum"`` and a
``count(targets)`` is normalised here by the total count over the whole step instead:

    loss = Σ_replicas Σ_microbatches sum_loss(i) / N,   N = Σ_replicas Σ_microbatches count(i)

which is what the single-process model computes on the whole batch. `PipelineEngine`'s
``train_batch`` / ``eval_batch`` do this by themselves for such a loss (`run_normalized`):
before each step every rank learns N (one small all-reduce) and the last stage multiplies
the summed loss by ``m · dp / N``; the engine's own ``/ m`` and the gradient reducer's
``/ dp`` then leave exactly ``1 / N``. A loss that sums but cannot count
(``reduction="sum"`` without ``count``) is refused (`plain_sum_problem`): averaging its
microbatch sums gives neither the single-process sum nor the mean.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipeline.errors import PipelineConfigError
from pipeline.model.module import PipelineModule
from pipeline.parallel.topology import RankPosition, Topology
from pipeline.runtime.batch import split_microbatches

__all__ = ["IGNORE_INDEX", "SummedLoss", "is_summed", "normalized_eval_batch",
           "normalized_train_batch", "plain_sum_problem", "run_normalized",
           "token_cross_entropy"]

IGNORE_INDEX = -100


class NormalizedEngine(Protocol):
    """What normalisation reads of `pipeline.runtime.engine.PipelineEngine` (named by its
    shape: the engine imports this module, so this module does not import the engine)."""

    module: PipelineModule
    position: RankPosition
    topology: Topology

    @property
    def num_microbatches(self) -> int: ...

    def is_last_stage(self) -> bool: ...

    def train_batch(self, inputs: Any = None, targets: Any = None, *,
                    data_iter: Iterator[tuple[Any, Any]] | None = None) -> float: ...

    def eval_batch(self, inputs: Any = None, targets: Any = None, *,
                   data_iter: Iterator[tuple[Any, Any]] | None = None) -> Any: ...


class SummedLoss:
    """A loss that sums over items, with the count of items it summed: the contract the
    normalised steps look for (``reduction == "sum"`` and ``count``).

    ``scale`` is set by `normalized_train_batch` before each step (1 outside one)."""

    reduction: Literal["sum"] = "sum"

    def __init__(self, loss_sum: Callable[[Any, Any], torch.Tensor],
                 count: Callable[[Any], int | torch.Tensor], name: str = "summed loss") -> None:
        if not callable(loss_sum) or not callable(count):
            raise TypeError(f"SummedLoss needs callables loss_sum(outputs, targets) and "
                            f"count(targets), got {loss_sum!r} and {count!r}")
        self.loss_sum = loss_sum
        self.count = count
        self.name = name
        self.scale = 1.0

    def __call__(self, outputs: Any, targets: Any) -> torch.Tensor:
        return self.loss_sum(outputs, targets) * self.scale

    def __repr__(self) -> str:
        return f"SummedLoss({self.name})"


def token_cross_entropy(*, ignore_index: int = IGNORE_INDEX, shift: bool = False
                        ) -> SummedLoss:
    """Cross entropy summed over target tokens that are not `ignore_index`, counting them.

    With `shift`, token t predicts target t+1 (a causal LM whose targets are its inputs, as
    HF's ``labels``)."""
    def targets_of(labels: torch.Tensor) -> torch.Tensor:
        return F.pad(labels, (0, 1), value=ignore_index)[..., 1:] if shift else labels

    def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, -2), targets_of(labels).flatten(),
                               ignore_index=ignore_index, reduction="sum")

    def count(labels: torch.Tensor) -> torch.Tensor:
        return (targets_of(labels) != ignore_index).sum()

    return SummedLoss(loss_sum, count, f"token cross entropy, ignore_index={ignore_index}"
                      + (", shifted" if shift else ""))


def is_summed(loss_fn: object) -> bool:
    """Whether `loss_fn` follows the summed contract (``reduction == "sum"`` and ``count``)."""
    return getattr(loss_fn, "reduction", None) == "sum" and callable(
        getattr(loss_fn, "count", None)) and hasattr(loss_fn, "scale")


def plain_sum_problem(loss_fn: object) -> str | None:
    """Why `loss_fn` cannot train in a pipeline, when it sums over items (``reduction ==
    "sum"``, also through a partial) without the ``count`` that would normalise it."""
    reduction = getattr(loss_fn, "reduction", None)
    if isinstance(loss_fn, functools.partial):
        reduction = loss_fn.keywords.get("reduction", reduction)
    if reduction != "sum" or is_summed(loss_fn):
        return None
    return (f"loss_fn {loss_fn!r} sums over items (reduction='sum') but has no count(targets): "
            "the engine averages the m microbatch losses, which for sums is neither the "
            "single-process sum nor the mean; use reduction='mean', or a "
            "pipeline.runtime.loss_normalization.SummedLoss(loss_sum, count) (e.g. "
            "token_cross_entropy()) which the engine normalises by the step's item count")


def _summed(engine: NormalizedEngine) -> SummedLoss:
    loss_fn = engine.module.loss_fn
    if not is_summed(loss_fn):
        raise PipelineConfigError(
            f"normalised steps need a loss with reduction='sum' and count(targets) (a "
            f"pipeline.runtime.loss_normalization.SummedLoss such as token_cross_entropy()), "
            f"got {loss_fn!r}; build the PipelineModule with loss_fn=token_cross_entropy()")
    return loss_fn  # type: ignore[return-value]


def _set_scale(engine: NormalizedEngine, loss_fn: SummedLoss, targets: list[Any] | None) -> None:
    """Every rank learns N, the items counted over the whole step (one all-reduce over the
    world: each dp replica's last stage contributes once, each cp rank its own tokens); the
    last stage sets scale = m · dp · cp / N (the reducer averages over dp × cp). Every rank
    refuses a step that counts nothing, together."""
    counted = torch.zeros((), dtype=torch.float64)
    if targets is not None and engine.position.tp_rank == 0:
        for part in targets:
            counted += torch.as_tensor(loss_fn.count(part), dtype=torch.float64).cpu()
    dist.all_reduce(counted)
    total = float(counted)
    if total <= 0:
        raise PipelineConfigError(f"{loss_fn!r} counts no items in this step's targets (every "
                                  "label is ignored?); give each batch at least one real token")
    loss_fn.scale = engine.num_microbatches * engine.topology.gradient_replicas / total


def _take(engine: NormalizedEngine, targets: Any, data_iter: Iterator[Any] | None
          ) -> tuple[list[Any] | None, Iterator[Any] | None]:
    """This step's target microbatches (None off the last stage), and an iterator that
    replays what was taken from `data_iter`."""
    m = engine.num_microbatches
    if data_iter is not None:
        pairs = [next(data_iter, None) for _ in range(m)]
        taken = [pair for pair in pairs if pair is not None]
        parts = [pair[1] for pair in taken if isinstance(pair, tuple | list) and len(pair) == 2]
        return (parts if engine.is_last_stage() and len(parts) == m else None), iter(taken)
    if not engine.is_last_stage() or targets is None:
        return None, None
    return split_microbatches(targets, m, "targets"), None


def normalized_train_batch(engine: NormalizedEngine, inputs: Any = None, targets: Any = None, *,
                           data_iter: Iterator[Any] | None = None) -> float:
    """`PipelineEngine.train_batch` with the loss and gradients normalised by the total item
    count of the step (over microbatches and data-parallel replicas); returns that loss.
    (The engine normalises a summed loss by itself: this also refuses a mean loss.)"""
    _summed(engine)
    return engine.train_batch(inputs, targets, data_iter=data_iter)


def normalized_eval_batch(engine: NormalizedEngine, inputs: Any = None, targets: Any = None, *,
                          data_iter: Iterator[Any] | None = None) -> Any:
    """`PipelineEngine.eval_batch` whose `last_loss` is the item-weighted mean."""
    _summed(engine)
    return engine.eval_batch(inputs, targets, data_iter=data_iter)


def run_normalized(engine: NormalizedEngine, step: Callable[..., Any], inputs: Any, targets: Any,
                   data_iter: Iterator[Any] | None) -> Any:
    """Run `step` (the engine's plain train or eval step) with the summed loss scaled by the
    step's total item count, then put the scale back."""
    loss_fn = _summed(engine)
    parts, replay = _take(engine, targets, data_iter)
    _set_scale(engine, loss_fn, parts)
    try:
        if replay is not None:
            return step(data_iter=replay)
        return step(inputs, targets)
    finally:
        loss_fn.scale = 1.0
