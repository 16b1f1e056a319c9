"""Two-batch overlap: a forward runs as two halves of its microbatch taking turns.

DualPipeV's F&B pairs hide one microbatch's expert all-to-all under another's compute, but
only the main phase has pairs: warm-up forwards run alone, every dispatch and combine
exposed. Cut such a forward's microbatch in two by rows and run the halves as the two
threads of `pipeline.moe.interleave` (half 0 starts): one half's dispatch or combine is in
flight while the other computes, so a forward whose parts all cost t takes 2.5t, not 4t
(`schedules.analysis.all_to_all.two_batch_forward` prices it). SGLang calls this two-batch
overlap; DeepSeek-V3's report (§3.4) runs two micro-batches so in its inference.

The backward is not split: autograd runs the two halves' graphs in one call, one after
the other. So that a pair's backward of such a graph (which hands over at each half's
all-to-all) stays in step with the pair's forward, a forward inside an overlapped pair
runs as halves too, one after the other on the pair's forward thread: the pair's order
repeated twice at half size, which costs what the whole pair costs.

How a stage's input is cut and its output joined (`Batch`: a tensor or a tuple of them):
a tensor whose first dimension is the microbatch's rows (those of its first tensor) is
split by rows and the halves' outputs concatenated; a tuple position the stage's layers
declare a row sum (``row_sums = (k, ...)``, e.g. the carried load-balancing loss of the HF
MoE adapter), when its input is not split by rows, goes whole to half 0 and as zeros to
half 1, and the halves' outputs there add; any other tensor goes to both halves as is, and
both must give back the same value (a tensor of neither kind whose first dimension is
the halves' rows is read as rows). The result equals the unsplit forward wherever every
layer treats rows independently (no batch norm, no capacity factor, no dropout: the engine
refuses the last two).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from pipeline.errors import PipelineConfigError
from pipeline.model.module import PipelineModule
from pipeline.moe.interleave import has_expert_all_to_all, run_interleaved
from pipeline.runtime.batch import Batch

__all__ = ["declared_row_sums", "join_halves", "split_rows", "two_batch_forward",
           "two_batch_problem", "two_batch_stages"]

_R = TypeVar("_R")


def declared_row_sums(stage: nn.Module) -> frozenset[int]:
    """Tuple positions the layers of `stage` declare sums over the rows (``row_sums``)."""
    return frozenset(k for m in stage.modules() for k in getattr(m, "row_sums", ()))


def split_rows(x: Batch, sums: frozenset[int]) -> tuple[Batch, Batch] | None:
    """`x` cut into two halves by rows (module docstring); None when it has fewer than two
    rows (nothing to split)."""
    tensors = (x,) if isinstance(x, torch.Tensor) else x
    if not tensors or tensors[0].dim() == 0 or tensors[0].shape[0] < 2:
        return None
    rows = tensors[0].shape[0]
    first, second = [], []
    for k, t in enumerate(tensors):
        if t.dim() > 0 and t.shape[0] == rows:
            first.append(t[: rows // 2])
            second.append(t[rows // 2:])
        elif k in sums and not isinstance(x, torch.Tensor):
            first.append(t)
            second.append(torch.zeros_like(t))
        else:
            first.append(t)
            second.append(t)
    if isinstance(x, torch.Tensor):
        return first[0], second[0]
    return tuple(first), tuple(second)


def join_halves(first: Batch, second: Batch, rows: tuple[int, int], sums: frozenset[int],
                stage: str) -> Batch:
    """The halves' outputs (of `rows` rows each) as the whole microbatch's (module
    docstring); a position that is neither rows nor a declared sum and differs between the
    halves is refused."""
    if isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor):
        return _join(0, first, second, rows, frozenset(), stage)
    if isinstance(first, torch.Tensor) or isinstance(second, torch.Tensor) \
            or len(first) != len(second):
        raise PipelineConfigError(f"two_batch_overlap: {stage} gave outputs of different "
                                  "structure for the two halves of a microbatch")
    return tuple(_join(k, a, b, rows, sums, stage)
                 for k, (a, b) in enumerate(zip(first, second)))


def _join(k: int, a: torch.Tensor, b: torch.Tensor, rows: tuple[int, int],
          sums: frozenset[int], stage: str) -> torch.Tensor:
    if k in sums:
        return a + b
    if a is b:
        return a  # passed through (a position not split by rows)
    if a.dim() > 0 and b.dim() > 0 and (a.shape[0], b.shape[0]) == rows \
            and a.shape[1:] == b.shape[1:] and a.dtype == b.dtype:
        return torch.cat((a, b))
    if a.shape == b.shape and torch.equal(a, b):
        return a  # a value that does not depend on the rows (half 0's carries the gradient)
    raise PipelineConfigError(
        f"two_batch_overlap: output {k} of {stage} (shapes {tuple(a.shape)} and "
        f"{tuple(b.shape)}) is neither split by rows nor the same for both halves of a "
        "microbatch; if it is a sum over the rows (a carried loss), declare it with a "
        f"`row_sums = ({k},)` attribute on the stage's layers, else turn two_batch_overlap off")


def two_batch_forward(run: Callable[[Batch], _R], x: Batch, sums: frozenset[int],
                      join: Callable[[_R, _R, tuple[int, int]], _R], *,
                      interleaved: bool = True) -> tuple[_R, int] | None:
    """`run` on the two halves of `x` taking turns at their all-to-alls (half 0 starts, on
    a helper thread in a copy of this context, which holds the forward key; autocast is per
    thread, so `run` sets it, and grad mode, per thread too, is on in a new one as training
    needs), joined by `join` given the halves' rows, and how many times the turn passed;
    None when `x` cannot be split. Not `interleaved` (this thread already takes turns, in
    an overlapped pair): the halves run one after the other here, each handing over at its
    own all-to-alls."""
    halves = split_rows(x, sums)
    if halves is None:
        return None
    results: list[Any] = [None, None]

    def half(k: int) -> Callable[[], None]:
        context = contextvars.copy_context()

        def body() -> None:
            results[k] = context.run(run, halves[k])
        return body

    if interleaved:
        handovers = run_interleaved(half(0), half(1))
    else:  # already one of two threads taking turns: the halves in order, on this one
        results = [run(halves[0]), run(halves[1])]
        handovers = 0
    rows = (x if isinstance(x, torch.Tensor) else x[0]).shape[0]
    return join(results[0], results[1], (rows // 2, rows - rows // 2)), handovers


def two_batch_problem(stage: nn.Module) -> str | None:
    """Why `stage` cannot run two-batch forwards exactly (None if it can): a capacity factor
    (each half would get its own capacity) or active dropout (each half draws its own
    masks from the microbatch's seed)."""
    for name, m in stage.named_modules():
        own = getattr(m, "two_batch_problem", None)  # a layer that knows (MoE balancing)
        problem = own() if callable(own) else None
        if problem is not None:
            return f"{name}: {problem}"
        capacity = getattr(getattr(m, "config", None), "capacity_factor", None)
        if hasattr(m, "dispatcher") and capacity is not None:
            return (f"{name} drops tokens past a capacity factor ({capacity}), which each "
                    "half would apply to its own rows")
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return f"{name} is a dropout of p={m.p}, whose masks each half would draw anew"
        attention = getattr(m, "attention_dropout", 0.0)  # HF attention's functional dropout
        if isinstance(attention, float) and attention > 0:
            return (f"{name} drops attention weights (attention_dropout={attention}), whose "
                    "masks each half would draw anew")
    return None


def two_batch_stages(module: PipelineModule, stages: Iterable[int],
                     device: torch.device) -> frozenset[int]:
    """Which of this rank's `stages` run two-batch forwards: those with an expert
    all-to-all. Refused on every rank alike (one all-reduce over the world, so no rank is
    left waiting): a stage that cannot do it exactly (`two_batch_problem`), or no stage on
    any rank with an all-to-all to hide."""
    chosen, problems = [], []
    for s in stages:
        stage = module.stage(s)
        if has_expert_all_to_all(stage):
            chosen.append(s)
            problem = two_batch_problem(stage)
            if problem is not None:
                problems.append(f"stage {s}: {problem}")
    found = torch.tensor([float(bool(chosen)), float(bool(problems))], device=device)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    if problems or found[1].item():
        why = "; ".join(problems) or "another rank's stage cannot (its error says why)"
        raise PipelineConfigError(f"two_batch_overlap: {why}; turn two_batch_overlap off "
                                  "for this model")
    if not found[0].item():
        raise PipelineConfigError(
            "two_batch_overlap=True, but no stage runs an expert all-to-all (MoE layers "
            "with expert_parallel > 1, or layers with all_to_all_inside = True): there is "
            "nothing for the halves to hide; turn two_batch_overlap off or set expert_parallel")
    return frozenset(chosen)
