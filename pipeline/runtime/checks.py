"""`PipelineEngine`'s arguments checked before any collective or allocation, all at once."""

from __future__ import annotations

import math

import torch

from pipeline.errors import PipelineConfigError
from pipeline.parallel.groups import ProcessGroups
from pipeline.parallel.topology import Topology

__all__ = ["check_engine_arguments"]


def check_engine_arguments(*, optimizer: object, topology: object, groups: object,
                           gradient_reducer: object, device: object, timeout: object,
                           dynamic_shapes: object) -> None:
    """Raise one `PipelineConfigError` listing every argument of the wrong type or range.

    Pure, so every rank refuses the same arguments without waiting for the others; before
    the module is materialized, so a bad optimizer is refused before any layer is built.
    """
    problems = []  # schedule and num_microbatches: `plan.resolve_schedule` checks them
    if optimizer is not None and not (isinstance(optimizer, torch.optim.Optimizer)
                                      or callable(optimizer)):
        problems.append(f"optimizer must be a torch.optim.Optimizer or a factory "
                        f"`lambda params: torch.optim.SGD(params, lr=0.1)`, got {optimizer!r}")
    if topology is not None and not isinstance(topology, Topology):
        problems.append(f"topology must be a pipeline.Topology(pp, dp, tp), got {topology!r}")
    if groups is not None and not isinstance(groups, ProcessGroups):
        problems.append(f"groups must be pipeline.parallel.groups.ProcessGroups, got {groups!r}")
    if gradient_reducer is not None and not all(
            callable(getattr(gradient_reducer, name, None)) for name in ("reduce_stage", "wait")):
        problems.append(f"gradient_reducer must have reduce_stage(stage, params) and wait() "
                        f"(a pipeline.GradReducer), got {gradient_reducer!r}")
    if device is not None and not isinstance(device, torch.device):
        problems.append(f"device must be None or a torch.device such as torch.device('cpu'), "
                        f"got {device!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not (
            math.isfinite(timeout) and timeout > 0):
        problems.append(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    if not isinstance(dynamic_shapes, bool):
        problems.append(f"dynamic_shapes must be True or False, got {dynamic_shapes!r}")
    if problems:
        raise PipelineConfigError("PipelineEngine: " + "; ".join(problems))
