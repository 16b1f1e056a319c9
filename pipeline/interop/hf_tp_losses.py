"""The vocab-parallel losses of `tensor_parallel_hf`'s models (dense and mixture-of-experts)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pipeline.interop.hf_modules_tp import VocabSlot
from pipeline.interop.hf_shared import IGNORE_INDEX, causal_lm_loss
from pipeline.parallel.tensor.overlap import REAL_OPS, TensorParallelOps
from pipeline.parallel.tensor.vocab_cross_entropy import vocab_parallel_token_losses
from pipeline.runtime.loss_normalization import SummedLoss

__all__ = ["BalancedVocabSummedLoss", "TensorParallelPlan", "count_targets", "mean_loss",
           "moe_mean_loss", "summed_loss"]


@dataclasses.dataclass(frozen=True)
class TensorParallelPlan:
    """What every split layer of one `tensor_parallel_hf` model shares."""

    config: Any
    sequence_parallel: bool
    slot: VocabSlot = dataclasses.field(compare=False)
    overlap: bool = False
    chunks: int = 2
    ops: TensorParallelOps = dataclasses.field(default=REAL_OPS, compare=False)
    shift_labels: bool = True


def _shifted(labels: torch.Tensor, shift: bool = True) -> torch.Tensor:
    """Token t's target: label t+1 (HF's labels), or label t (targets shifted already)."""
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:] if shift \
        else labels


def _token_losses(plan: TensorParallelPlan, logits: torch.Tensor, labels: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    return vocab_parallel_token_losses(logits, _shifted(labels, plan.shift_labels),
                                       plan.slot.vocab_start,
                                       plan.slot.group, IGNORE_INDEX)


def _split(plan: TensorParallelPlan, logits: torch.Tensor) -> bool:
    """Whether the logits are a vocabulary slice (an engine rank at tp > 1), not whole."""
    return logits.shape[-1] != plan.config.vocab_size


def _whole_loss(plan: TensorParallelPlan, logits: torch.Tensor, labels: torch.Tensor
                ) -> torch.Tensor:
    if plan.shift_labels:
        return causal_lm_loss(logits, labels)
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), labels.flatten(),
                                             ignore_index=IGNORE_INDEX)


def mean_loss(plan: TensorParallelPlan, logits: torch.Tensor, labels: torch.Tensor
              ) -> torch.Tensor:
    """Mean token cross entropy of whole logits or of this rank's vocabulary slice."""
    if not _split(plan, logits):
        return _whole_loss(plan, logits, labels)
    losses, counted = _token_losses(plan, logits, labels)
    return losses.sum() / counted.sum()


def summed_loss(plan: TensorParallelPlan, logits: torch.Tensor, labels: torch.Tensor
                ) -> torch.Tensor:
    """Summed token cross entropy (of whole logits or of this rank's vocabulary slice)."""
    if not _split(plan, logits):
        return _whole_loss(plan, logits, labels) * count_targets(plan, labels)
    return _token_losses(plan, logits, labels)[0].sum()


def count_targets(plan: TensorParallelPlan, labels: torch.Tensor) -> torch.Tensor:
    """The targets the summed loss counts (not `IGNORE_INDEX`)."""
    return (_shifted(labels, plan.shift_labels) != IGNORE_INDEX).sum()


def moe_mean_loss(plan: TensorParallelPlan, outputs: tuple[torch.Tensor, torch.Tensor],
                  labels: torch.Tensor) -> torch.Tensor:
    """`mean_loss` of the logits plus the carried balancing loss (already summed over tp
    by the head), as HF's MoE models add it."""
    return mean_loss(plan, outputs[0], labels) + outputs[1].sum()


class BalancedVocabSummedLoss(SummedLoss):
    """`summed_loss` (scaled per step) plus the carried balancing loss, which
    `pipeline.moe.balance_loss.BalanceLoss` already scales for the engine's normalisation."""

    def __call__(self, outputs: Any, targets: Any) -> torch.Tensor:
        return self.loss_sum(outputs[0], targets) * self.scale + outputs[1].sum()
