"""A DeepSpeed config's ``optimizer`` and ``scheduler`` sections, as DeepSpeed 0.19.8 builds them.

What DeepSpeed builds (``DeepSpeedEngine._configure_basic_optimizer``, ``_scheduler_from_config``):

- ``"Adam"`` / ``"AdamW"`` (any case): its FusedAdam — defaults lr 1e-3, betas (0.9, 0.999),
  eps 1e-8, **weight_decay 0** — in AdamW mode (decoupled decay) unless ``adam_w_mode`` is
  false, which only ``"Adam"`` obeys. Built here as torch's AdamW / Adam with those defaults
  (the same update). With ``torch_adam: true`` DeepSpeed builds torch's AdamW / Adam from the
  params as given, so torch's defaults apply (AdamW's weight_decay is then 0.01): so here too.
- ``"Adagrad"``: torch's Adagrad. Any other name DeepSpeed looks up in ``torch.optim`` as
  written (``"SGD"``, ``"RMSprop"``); its own Lamb, Lion, Muon and MuP optimizers are refused.
- Schedulers: ``WarmupLR`` and ``WarmupDecayLR`` with DeepSpeed's step count (the learning
  rate is ``warmup_min_lr`` for the first two steps: it starts at iteration -1), or any
  ``torch.optim.lr_scheduler`` class by name; OneCycle, LRRangeTest and WarmupCosineLR are
  refused.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pipeline.errors import PipelineConfigError
from pipeline.parallel.optimizer import OptimizerFactory

__all__ = ["WarmupDecayLR", "WarmupLR", "make_optimizer_factory", "make_scheduler"]

_FUSED_ADAM_DEFAULTS: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                                        "weight_decay": 0.0}
"""DeepSpeed's FusedAdam (and CPU Adam) defaults: no weight decay unless asked."""
_FUSED_ADAM_SAME_ANY_VALUE = {"set_grad_none", "fp32_optimizer_states"}
"""FusedAdam params that do not change the update (grads to None; CPU-offload state dtype,
which DeepSpeed drops without offload)."""
_DEEPSPEED_ONLY = {"lamb", "lion", "muon", "muadam", "muadamw", "musgd", "onebitadam",
                   "zerooneadam", "onebitlamb"}


def _adam(kind: str, params: dict[str, Any]) -> tuple[type[torch.optim.Optimizer],
                                                       dict[str, Any]]:
    """(class, kwargs) DeepSpeed's Adam/AdamW section builds, with the same update."""
    adam_w_mode = bool(params.pop("adam_w_mode", True))
    adam_w = kind == "adamw" or adam_w_mode  # "AdamW" ignores adam_w_mode: false
    cls: type[torch.optim.Optimizer] = torch.optim.AdamW if adam_w else torch.optim.Adam
    if params.pop("torch_adam", False):  # torch's class with the params as given
        params.pop("fp32_optimizer_states", None)
        return cls, params
    if params.pop("bias_correction", True) is not True:
        raise PipelineConfigError("optimizer.params.bias_correction=false is not available "
                                  "here; drop it (torch's Adam always corrects the bias)")
    if params.pop("amsgrad", False):
        raise PipelineConfigError("optimizer.params.amsgrad=true: DeepSpeed's FusedAdam refuses "
                                  "it too; drop it, or add \"torch_adam\": true")
    for key in _FUSED_ADAM_SAME_ANY_VALUE:
        params.pop(key, None)
    unknown = sorted(set(params) - set(_FUSED_ADAM_DEFAULTS))
    if unknown:
        raise PipelineConfigError(f"optimizer.params {unknown} are not parameters of DeepSpeed's "
                                  f"Adam (lr, betas, eps, weight_decay, adam_w_mode, "
                                  "bias_correction, torch_adam); remove them")
    return cls, {**_FUSED_ADAM_DEFAULTS, **params}


def make_optimizer_factory(section: Mapping[str, Any]) -> OptimizerFactory:
    """``params -> optimizer`` for an ``optimizer`` section, as DeepSpeed builds it."""
    name = str(section["type"])
    kind = name.lower()
    params = dict(section.get("params") or {})
    if "max_grad_norm" in params:
        raise PipelineConfigError("optimizer.params.max_grad_norm is refused by DeepSpeed too; "
                                  "use the top-level \"gradient_clipping\" key")
    if kind in ("adam", "adamw"):
        cls, kwargs = _adam(kind, params)
    elif kind == "adagrad":
        cls, kwargs = torch.optim.Adagrad, params
    elif kind in _DEEPSPEED_ONLY:
        raise PipelineConfigError(f"optimizer type {name!r} is DeepSpeed's own and not "
                                  "available here; use Adam, AdamW, Adagrad or a torch.optim "
                                  "class name, or pass initialize(optimizer=...)")
    else:
        found = getattr(torch.optim, name, None)
        if not (isinstance(found, type) and issubclass(found, torch.optim.Optimizer)):
            spelled = [n for n in dir(torch.optim) if n.lower() == kind]
            hint = f" (DeepSpeed looks torch.optim up as written: {spelled[0]!r})" \
                if spelled else ""
            raise PipelineConfigError(f"optimizer type {name!r} is not available{hint}; use "
                                      "Adam, AdamW, Adagrad or a torch.optim class name, or "
                                      "pass initialize(optimizer=...)")
        cls, kwargs = found, params
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])

    def factory(parameters: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
        try:
            return cls(parameters, **kwargs)
        except TypeError as error:
            raise PipelineConfigError(f"optimizer {name!r} params {kwargs}: {error}; fix "
                                      "optimizer.params") from error
    return factory


def _per_group(optimizer: torch.optim.Optimizer, value: float | Sequence[float], name: str
               ) -> list[float]:
    groups = len(optimizer.param_groups)
    if not isinstance(value, Sequence):
        return [float(value)] * groups
    if len(value) != groups:
        raise PipelineConfigError(f"scheduler.params.{name} lists {len(value)} values for "
                                  f"{groups} parameter groups")
    return [float(v) for v in value]


class WarmupLR(torch.optim.lr_scheduler.LRScheduler):
    """DeepSpeed's WarmupLR: from ``warmup_min_lr`` to ``warmup_max_lr`` (default: the
    optimizer's lr) over ``warmup_num_steps`` (log or linear), then constant.

    DeepSpeed counts from iteration -1 (the learning rate at construction is the minimum) and
    steps after every optimizer step, so steps 1 and 2 both run at ``warmup_min_lr``; here
    iteration = torch's ``last_epoch`` - 1 gives the same sequence."""

    def __init__(self, optimizer: torch.optim.Optimizer, *,
                 warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] | None = None,
                 warmup_num_steps: int = 1000, warmup_type: str = "log") -> None:
        if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or \
                warmup_num_steps <= 0:
            raise PipelineConfigError(f"scheduler.params.warmup_num_steps must be an int > 0, "
                                      f"got {warmup_num_steps!r}")
        if warmup_type not in ("log", "linear"):
            raise PipelineConfigError(f"scheduler.params.warmup_type must be 'log' or 'linear', "
                                      f"got {warmup_type!r}")
        if warmup_max_lr is None:
            warmup_max_lr = [float(group["lr"]) for group in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        super().__init__(optimizer)

    def gamma(self, iteration: int) -> float:
        """The fraction of the way from the minimum to the maximum at `iteration`."""
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_steps:
            if self.warmup_type == "log":
                return math.log(iteration + 1) / math.log(self.warmup_steps)
            return iteration / self.warmup_steps
        return 1.0

    def get_lr(self) -> list[float]:  # type: ignore[override]
        gamma = self.gamma(self.last_epoch - 1)
        return [low + (high - low) * gamma for low, high in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """DeepSpeed's WarmupDecayLR: WarmupLR (``warmup_max_lr`` default 0.001), then linearly
    down to ``warmup_min_lr`` at ``total_num_steps``."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, *,
                 warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log") -> None:
        self.total_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr=warmup_min_lr, warmup_max_lr=warmup_max_lr,
                         warmup_num_steps=warmup_num_steps, warmup_type=warmup_type)

    def gamma(self, iteration: int) -> float:
        if iteration < self.warmup_steps:
            return super().gamma(iteration)
        return max(0.0, (self.total_steps - iteration)
                   / max(1.0, self.total_steps - self.warmup_steps))


_SCHEDULERS: dict[str, type[WarmupLR]] = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR}
_DEEPSPEED_SCHEDULERS = ("OneCycle", "LRRangeTest", "WarmupCosineLR")


def make_scheduler(section: Mapping[str, Any], optimizer: torch.optim.Optimizer
                   ) -> torch.optim.lr_scheduler.LRScheduler:
    """The learning-rate scheduler of a ``scheduler`` section, as DeepSpeed builds it."""
    kind = str(section["type"])
    params = dict(section.get("params") or {})
    if "last_batch_iteration" in params:
        raise PipelineConfigError("scheduler.params.last_batch_iteration is not available "
                                  "here; resume with load_checkpoint instead")
    if kind in _SCHEDULERS:
        cls: Any = _SCHEDULERS[kind]
        if kind == "WarmupDecayLR" and "total_num_steps" not in params:
            raise PipelineConfigError("WarmupDecayLR needs scheduler.params.total_num_steps")
    elif kind in _DEEPSPEED_SCHEDULERS:
        raise PipelineConfigError(f"scheduler type {kind!r} is not available here; use "
                                  "WarmupLR, WarmupDecayLR or a torch.optim.lr_scheduler class, "
                                  "or pass initialize(lr_scheduler=...)")
    else:
        cls = getattr(torch.optim.lr_scheduler, kind, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.lr_scheduler.LRScheduler)):
            raise PipelineConfigError(f"scheduler type {kind!r} is neither DeepSpeed's WarmupLR "
                                      "/ WarmupDecayLR nor a torch.optim.lr_scheduler class")
    try:
        scheduler: torch.optim.lr_scheduler.LRScheduler = cls(optimizer, **params)
    except TypeError as error:
        raise PipelineConfigError(f"scheduler {kind!r} params {params}: {error}") from error
    return scheduler
