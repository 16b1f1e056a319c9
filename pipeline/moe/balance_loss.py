"""The auxiliary load-balancing loss of a whole step, exactly as HF computes it on the batch.

HF (``load_balancing_loss_func``, Switch Transformer eqs. 4-6) sums, over every MoE layer
and every token of the batch, the top-k assignments T_e and the router probabilities P_e of
each expert e, counts the rows R (tokens × layers) and adds

    coef · E · Σ_e (T_e / R) · (P_e / R)

to the loss. That is bilinear in two whole-batch sums, so the sum of per-microbatch losses
is not it, and its gradient with respect to one microbatch's probabilities, coef·E·T/R², needs
T of the whole batch, which a 1F1B schedule has not seen when that microbatch's backward
runs (carrying T and P to the last stage fixes the value, not the gradient). So a step runs
a forward-only census first (the engine's eval schedule: routing only needs a forward),
all-reduces T and R over the world, and then trains with every layer adding its exact share
coef·E/R²·(T·P_layer,microbatch) to a scalar carried with the activations to the loss:
those shares sum to HF's term and give exactly its gradient, for any schedule. The price is
one extra forward per step; routing must be deterministic (no router jitter or dropout), so
the census sees the routes the training forward takes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist

from pipeline.errors import PipelineConfigError
from pipeline.moe.routing import RouterStatistics

__all__ = ["BalanceLoss", "eval_batch_balanced", "train_batch_balanced"]


class BalanceLoss:
    """One rank's handle on the step's load-balancing loss, shared by its MoE layers."""

    def __init__(self, num_experts: int, coefficient: float) -> None:
        self.num_experts = num_experts
        self.coefficient = coefficient
        self.phase: Literal["idle", "census", "known"] = "idle"
        self._counts = torch.zeros(num_experts)
        self._rows = torch.zeros(())
        self._scale = 0.0
        """coef · E / R² · m · dp: the engine divides each microbatch's loss by m and
        averages the dp replicas' gradients, which this undoes for a term already summed."""

    def share(self, stats: RouterStatistics) -> torch.Tensor:
        """This layer's share of the step's loss on one microbatch (0 during the census,
        which records the statistics instead)."""
        if self.phase == "idle":
            raise PipelineConfigError(
                "this model adds HF's router load-balancing loss (output_router_logits=True), "
                "which needs the whole step's expert counts before any backward: train with "
                "pipeline.moe.balance_loss.train_batch_balanced(engine, balance, inputs, "
                "targets) (or eval_batch_balanced), not engine.train_batch, or balance "
                "without a census: layers_from_hf(config, balancing='microbatch') "
                "(Megatron-Core's per-microbatch loss), 'sequence', 'aux-free' or 'none'")
        if self.phase == "census":
            self._counts += stats.counts.detach().cpu()
            self._rows += stats.rows.detach().cpu()
            return stats.prob_sums.new_zeros(())
        counts = self._counts.to(stats.prob_sums.device)
        return torch.dot(counts, stats.prob_sums) * self._scale

    def begin_census(self) -> None:
        self._counts.zero_()
        self._rows.zero_()
        self.phase = "census"

    def finish_census(self, replicas: int, num_microbatches: int,
                      device: torch.device | None = None) -> None:
        """Sum T and R over every rank (each layer of each replica counted once; on
        `device`, where the default group's backend needs it), then fix the scale of each
        layer's share for the training forward."""
        totals = torch.cat([self._counts, self._rows.reshape(1)]).double().to(device)
        dist.all_reduce(totals)
        totals = totals.cpu()
        self._counts = totals[:-1].float()
        rows = float(totals[-1])
        if rows <= 0:
            raise PipelineConfigError("the router census counted no tokens (every token is "
                                      "padding?); give each batch at least one real token")
        self._scale = (self.coefficient * self.num_experts / rows ** 2
                       * num_microbatches * replicas)
        self.phase = "known"

    def end_step(self) -> None:
        self.phase = "idle"


def _balanced(run: Callable[..., Any], engine: Any, balance: BalanceLoss | None,
              inputs: Any, targets: Any) -> Any:
    if balance is None:
        return run(inputs, targets)
    balance.begin_census()
    try:
        engine.eval_batch(inputs)
        balance.finish_census(engine.topology.dp, engine.num_microbatches, engine.device)
        return run(inputs, targets)
    finally:
        balance.end_step()


def train_batch_balanced(engine: Any, balance: BalanceLoss | None, inputs: Any = None,
                         targets: Any = None) -> float:
    """`engine.train_batch` whose loss includes the load-balancing loss as HF computes it on
    the whole batch (over every replica): a census forward, then the training step."""
    loss: float = _balanced(engine.train_batch, engine, balance, inputs, targets)
    return loss


def eval_batch_balanced(engine: Any, balance: BalanceLoss | None, inputs: Any = None,
                        targets: Any = None) -> Any:
    """`engine.eval_batch` likewise (its ``last_loss`` includes the balancing loss)."""
    return _balanced(engine.eval_batch, engine, balance, inputs, targets)
