"""The optimizer DeepSpeed's ``initialize`` builds from ``model_parameters`` and ``optimizer=``.

DeepSpeed 0.19.8 (``DeepSpeedEngine._configure_optimizer``):

- no client optimizer: the config's optimizer is built over ``model_parameters`` as given
  (a list of tensors is one group; a list of dicts keeps each group's own ``lr``,
  ``weight_decay``, ..., the config's params being the defaults);
- a client ``torch.optim.Optimizer``: used as it is (its groups and settings), with empty
  groups removed; ``model_parameters`` is then ignored;
- a client callable: called with ``model_parameters``.

Here the same, over this rank's stage (`pipeline.interop.ds_module` builds it at
construction so that ``model.parameters()`` holds it, as DeepSpeed's module does). Under
ZeRO-1 the factory gets the same model parameters and the engine carries the optimizer's
groups onto its shards (`pipeline.parallel.zero_groups`), as DeepSpeed's ZeRO keeps them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from pipeline.errors import PipelineConfigError
from pipeline.model.module import PipelineModule
from pipeline.parallel.optimizer import OptimizerFactory

__all__ = ["ClientOptimizer", "ParamGroups", "optimizer_for_initialize", "param_groups"]

ParamGroups = list[dict[str, Any]]
"""torch's parameter groups: ``[{"params": [tensors], "lr": ..., ...}, ...]``."""
ClientOptimizer = torch.optim.Optimizer | Callable[..., torch.optim.Optimizer]
"""What ``initialize(optimizer=)`` takes: an optimizer, or a callable building one."""

_BUILD_FIRST = ("build the model with pipeline.interop.deepspeed_compat.PipelineModule after "
                "deepspeed.init_distributed(): like DeepSpeed's, it then holds this rank's "
                "stage, so model.parameters() are the parameters this rank trains")


def param_groups(model_parameters: Any) -> ParamGroups | None:
    """``model_parameters`` as torch's groups (DeepSpeed's reading): None stays None, a list
    of tensors is one group, a list of dicts is kept (each dict copied, its params listed)."""
    if model_parameters is None:
        return None
    items = list(model_parameters)
    if items and all(isinstance(item, Mapping) for item in items):
        groups = []
        for index, group in enumerate(items):
            if "params" not in group:
                raise PipelineConfigError(f"model_parameters[{index}] has no 'params' key: "
                                          "a group is {'params': [tensors], 'lr': ..., ...}")
            params = group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            groups.append({**group, "params": params})
        return groups
    if not all(isinstance(item, torch.Tensor) for item in items):
        raise PipelineConfigError("model_parameters must be tensors (model.parameters()) or "
                                  "parameter groups ({'params': [...], 'lr': ...}), not a mix")
    return [{"params": items}]


def _check_owned(groups: ParamGroups, module: PipelineModule, where: str) -> None:
    """Refuse tensors that are not parameters of this rank's built stages."""
    owned = {id(p) for p in module.parameters()}
    strays = sum(1 for group in groups for p in group["params"] if id(p) not in owned)
    if strays:
        held = "holds none yet" if not owned else f"holds {len(owned)}"
        raise PipelineConfigError(
            f"{where} holds {strays} tensors that are not parameters of this rank's stage "
            f"(the module {held}); {_BUILD_FIRST}")


def _has_own_settings(groups: ParamGroups) -> bool:
    return any(set(group) - {"params"} for group in groups)


def _client_instance(optimizer: torch.optim.Optimizer, module: PipelineModule
                     ) -> OptimizerFactory:
    """A factory honouring a client optimizer as DeepSpeed does (empty groups removed)."""
    optimizer.param_groups[:] = [group for group in optimizer.param_groups if group["params"]]
    if not optimizer.param_groups:
        raise PipelineConfigError(f"initialize(optimizer={type(optimizer).__name__}) holds no "
                                  f"parameters; {_BUILD_FIRST}")
    _check_owned(optimizer.param_groups, module, "initialize(optimizer=)")

    def factory(_: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
        return optimizer  # the client's own object, as DeepSpeed steps it
    return factory


def optimizer_for_initialize(optimizer: ClientOptimizer | None, model_parameters: Any,
                             config_factory: OptimizerFactory | None, module: PipelineModule
                             ) -> OptimizerFactory | None:
    """The engine's optimizer factory for ``initialize(optimizer=, model_parameters=)`` and
    the config's optimizer (`config_factory`, built over a list of tensors or groups)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return _client_instance(optimizer, module)
    groups = param_groups(model_parameters)
    if groups is not None and not any(group["params"] for group in groups):
        if _has_own_settings(groups):
            raise PipelineConfigError(f"model_parameters' groups hold no parameters, so "
                                      f"their settings cannot apply; {_BUILD_FIRST}")
        groups = None  # a lazy module's empty model.parameters(): the engine's own list
    build = optimizer if optimizer is not None else config_factory
    if build is None or groups is None:
        return build
    _check_owned(groups, module, "model_parameters")
    chosen = groups

    def factory(_: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
        return build(chosen)  # type: ignore[arg-type]  # torch's optimizers take groups
    return factory
