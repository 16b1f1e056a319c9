"""`PipelineEngine`'s arguments checked before any collective or allocation, all at once;
and what must not change between its steps (which parameters train)."""

from __future__ import annotations

import torch

from pipeline.device import device_problem
from pipeline.errors import PipelineConfigError
from pipeline.model.module import PipelineModule
from pipeline.parallel.groups import ProcessGroups
from pipeline.parallel.topology import Topology

__all__ = ["check_engine_arguments", "trainable_change_problem", "trainable_parameters"]


def check_engine_arguments(*, optimizer: object, topology: object, groups: object,
                           gradient_reducer: object, device: object) -> None:
    """Raise one `PipelineConfigError` listing every object argument of the wrong type (the
    options are `EngineConfig`'s to check).

    Pure, so every rank refuses the same arguments without waiting for the others; before
    the module is materialized, so a bad optimizer is refused before any layer is built.
    """
    problems = []
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
    elif device is not None:
        missing = device_problem(device)
        if missing is not None:
            problems.append(missing)
    if problems:
        raise PipelineConfigError("PipelineEngine: " + "; ".join(problems))


def trainable_parameters(module: PipelineModule) -> frozenset[tuple[int, str]]:
    """(layer, name) of this rank's parameters that require gradients now."""
    return frozenset(key for key, param in module.named_layer_parameters()
                     if param.requires_grad)


def trainable_change_problem(built: frozenset[tuple[int, str]], module: PipelineModule
                             ) -> PipelineConfigError | None:
    """Why the next training step cannot run when `requires_grad` changed on this rank's
    parameters since the engine was built: its gradient buckets, ZeRO-1 shards and optimizer
    cover the parameters trainable then, so a parameter unfrozen later would never train (and
    one frozen later would still be stepped by some optimizers)."""
    now = trainable_parameters(module)
    if now == built:
        return None
    changes = [f"layer {layer} {name!r} {'un' if key in now else ''}frozen"
               for key in sorted(now ^ built) for layer, name in [key]]
    return PipelineConfigError(
        f"requires_grad changed after the engine was built ({', '.join(changes[:4])}"
        f"{', ...' if len(changes) > 4 else ''}); the engine's gradient buckets and optimizer "
        f"cover the parameters trainable when it was built: set requires_grad before building "
        f"PipelineEngine, or build a new engine (and optimizer) after changing it")
