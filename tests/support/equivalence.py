"""Differences between a pipelined training step and the single-process reference (test helpers)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline import PipelineEngine, PipelineModule
from pipeline.model.reference import ReferenceResult, build_reference, reference_step
from schedules import Schedule, figures, simulate
from tests.support.pipeline_models import MODELS

__all__ = ["TOLERANCE", "EngineCase", "describe_errors", "engine_case_problems",
           "gathered_weights", "max_error", "new_errors", "record_step", "run_engine_case", "sgd"]

TOLERANCE = 2e-5
ParamKey = tuple[int, str]


def new_errors(*extra: str) -> dict[str, float]:
    """Largest differences seen so far, per quantity: loss, grad, param (+ `extra`)."""
    return dict.fromkeys(("loss", "grad", "param", *extra), 0.0)


def gathered_weights(engine: PipelineEngine) -> dict[ParamKey, torch.Tensor]:
    """Every rank's parameters keyed by (global layer, name), on every rank (a collective)."""
    engine.finish_param_gather()  # overlap_param_gather: the last step's gathers in flight
    mine = {key: p.detach().clone() for key, p in engine.module.named_layer_parameters()}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {key: value for part in gathered for key, value in part.items()}


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def record_step(errors: dict[str, float], parameters: Iterable[tuple[ParamKey, nn.Parameter]],
                loss: float | None, expected: ReferenceResult, label: Any) -> None:
    """Fold one step into `errors`: the loss (None where this rank does not have it), every
    held parameter's gradient and its value after the optimizer step.

    Raises AssertionError when a parameter has no gradient (it took no part in the step).
    """
    if loss is not None:
        errors["loss"] = max(errors["loss"], abs(loss - expected.loss))
    for key, param in parameters:
        assert param.grad is not None, f"{label}: no gradient for layer {key}"
        errors["grad"] = max(errors["grad"], max_error(param.grad, expected.grads[key]))
        errors["param"] = max(errors["param"], max_error(param.detach(), expected.params[key]))


def describe_errors(rank: int, label: Any, errors: dict[str, float],
                    tolerance: float = TOLERANCE) -> list[str]:
    """One line per quantity that differs by more than `tolerance`."""
    return [f"rank {rank} {label}: {key} differs by {value:.3g}"
            for key, value in errors.items() if value > tolerance]


EngineCase = tuple[str, str, Schedule, int | None]
"""(label, model name in `MODELS`, schedule, memory limit the run must respect or None)."""


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def run_engine_case(p: int, case: EngineCase) -> dict[str, Any]:
    """Train `PipelineEngine` with the case's schedule on this rank for the model's steps
    (batch 3m) beside the reference; the largest errors and the measured and simulated peak
    of held activations."""
    label, model, schedule, limit = case
    spec = MODELS[model]
    m = schedule.num_microbatches
    module = PipelineModule(spec.layers(), num_stages=p, chunks=schedule.chunks,
                            loss_fn=spec.loss)
    engine = PipelineEngine(module, schedule=schedule, optimizer=sgd, timeout=30)
    reference = build_reference(spec.layers())
    errors = new_errors()
    peak = 0
    for step, length in enumerate(spec.lengths):
        inputs, targets = spec.batch(seed=step, batch=3 * m, length=length)
        loss = engine.train_batch(inputs, targets)
        expected = reference_step(reference, inputs, targets, loss_fn=spec.loss, optimizer=sgd)
        record_step(errors, module.named_layer_parameters(), loss, expected, label)
        assert engine.last_stats is not None
        peak = max(peak, engine.last_stats.peak_activations)
    simulated = figures(simulate(engine.schedule)).peak_activations[engine.pp_rank]
    return {"label": label, "errors": errors, "peak": peak, "simulated_peak": simulated,
            "limit": limit}


def engine_case_problems(per_rank: Sequence[Sequence[dict[str, Any]]]) -> list[str]:
    """Every difference over the tolerance, and every peak over the simulator's or the
    case's memory limit, in the per-rank results of `run_engine_case`."""
    problems = []
    for rank, results in enumerate(per_rank):
        for result in results:
            label, peak = result["label"], result["peak"]
            problems += describe_errors(rank, label, result["errors"])
            if peak > result["simulated_peak"]:
                problems.append(f"rank {rank} {label}: held {peak} activations, the simulator "
                                f"says {result['simulated_peak']}")
            if result["limit"] is not None and peak > result["limit"]:
                problems.append(f"rank {rank} {label}: held {peak} activations over the "
                                f"memory limit {result['limit']}")
    return problems
