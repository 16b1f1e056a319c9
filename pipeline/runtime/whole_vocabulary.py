"""A user's loss behind a vocab-parallel head receives whole logits: the tp slices gathered.

A last layer that splits the vocabulary over tp (`generation.SPLITS_VOCABULARY`, e.g.
`pipeline.interop.hf_tensor_parallel`'s heads) returns its rank's slice of the logits. Its
own loss (``hf.loss_fn`` / ``hf.summed_loss``) is written for slices (vocab-parallel cross
entropy, Megatron's, no gathered logits) and says so (`VOCAB_PARALLEL_LOSS`). Any other
loss expects (…, vocab) logits, and on a slice computed a silently wrong loss (or an
IndexError): the engine gathers the slices for it first, as Megatron's
``gather_from_tensor_model_parallel_region`` before a non-parallel loss (backward: each
rank keeps its slice of the gradient; every tp rank computes the same loss).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from pipeline.model.module import LossFn, PipelineModule
from pipeline.parallel.groups import ProcessGroups
from pipeline.runtime.generation import SPLITS_VOCABULARY

__all__ = ["VOCAB_PARALLEL_LOSS", "WholeVocabularyLoss", "gather_vocabulary",
           "loss_for_last_stage", "vocab_parallel_loss"]

VOCAB_PARALLEL_LOSS = "pipesched_vocab_parallel_loss"
"""Attribute (True) of a loss that takes its tp rank's vocabulary slice of the logits (it
reduces over tp itself); the engine then passes the slice unchanged."""


def vocab_parallel_loss(loss_fn: Any) -> Any:
    """Mark `loss_fn` as taking the vocabulary slices (see `VOCAB_PARALLEL_LOSS`); returns
    it. Without the mark a loss behind a vocab-parallel head gets the gathered logits."""
    setattr(loss_fn, VOCAB_PARALLEL_LOSS, True)
    return loss_fn


class _GatherVocabulary(torch.autograd.Function):
    """All-gather along the last dim of parts that may differ in width (`torch.tensor_split`
    parts of the vocabulary); backward keeps this rank's columns of the gradient."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        width = torch.tensor([logits.shape[-1]], dtype=torch.int64, device=logits.device)
        widths = [torch.empty_like(width) for _ in range(size)]
        dist.all_gather(widths, width, group=group)
        sizes = [int(w) for w in widths]
        widest = max(sizes)
        padded = torch.nn.functional.pad(logits, (0, widest - logits.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(parts, padded, group=group)
        ctx.start, ctx.width = sum(sizes[:rank]), sizes[rank]
        return torch.cat([part[..., :w] for part, w in zip(parts, sizes, strict=True)], dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad[..., ctx.start:ctx.start + ctx.width].contiguous(), None


def gather_vocabulary(logits: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The whole (…, vocab) logits from each tp rank's slice, in tp rank order."""
    out: torch.Tensor = _GatherVocabulary.apply(logits, group)
    return out


class WholeVocabularyLoss:
    """`loss_fn` called on the gathered logits. Its other attributes read through
    (``reduction``, ``count``, ``scale`` of a `SummedLoss`: the normalised steps set the
    scale on the module's loss, which this one reads)."""

    def __init__(self, loss_fn: LossFn, group: ProcessGroup) -> None:
        self.loss_fn, self.group = loss_fn, group

    def __call__(self, outputs: Any, targets: Any) -> torch.Tensor:
        if not isinstance(outputs, torch.Tensor):
            raise TypeError(f"the last stage splits the vocabulary over tp, so its output "
                            f"must be the logits tensor, got {type(outputs).__name__}")
        return self.loss_fn(gather_vocabulary(outputs, self.group), targets)

    def __getattr__(self, name: str) -> Any:
        if name in ("loss_fn", "group"):  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loss_fn, name)

    def __repr__(self) -> str:
        return f"{self.loss_fn!r} on the gathered vocabulary"


def loss_for_last_stage(module: PipelineModule, loss_fn: LossFn | None,
                        groups: ProcessGroups | None, tp: int) -> LossFn | None:
    """`loss_fn` as this rank's last stage calls it: wrapped in `WholeVocabularyLoss` when
    the rank holds the last stage, its layers split the vocabulary over tp > 1, and the
    loss is not marked `VOCAB_PARALLEL_LOSS`; else unchanged."""
    last = module.total_stages - 1
    if loss_fn is None or tp == 1 or groups is None or str(last) not in module.stages \
            or getattr(loss_fn, VOCAB_PARALLEL_LOSS, False):
        return loss_fn
    if not any(getattr(part, SPLITS_VOCABULARY, False) for part in module.stage(last).modules()):
        return loss_fn
    return WholeVocabularyLoss(loss_fn, groups.tp_group)
