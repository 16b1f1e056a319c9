"""The DeepSpeed config keys a pipeline job uses, read once into a typed value (`DSConfig`).

Read: ``train_batch_size``, ``train_micro_batch_size_per_gpu``,
``gradient_accumulation_steps`` (any two fix the third, as in DeepSpeed: batch = micro ×
accumulation × dp), ``optimizer`` and ``scheduler`` (type + params), ``fp16`` / ``bf16``,
``gradient_clipping``, ``zero_optimization.stage`` (≤ 1 with a pipeline) and
``steps_per_print``. Keys that only tune DeepSpeed's own machinery are listed in
`DSConfig.ignored` so nothing is dropped without a word.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from pipeline.errors import PipelineConfigError
from pipeline.parallel.optimizer import OptimizerFactory

__all__ = ["DSConfig", "WarmupLR", "make_optimizer_factory", "make_scheduler", "read_ds_config"]

_READ = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
         "optimizer", "scheduler", "fp16", "bf16", "gradient_clipping", "zero_optimization",
         "steps_per_print"}
_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adam": torch.optim.AdamW, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad, "rmsprop": torch.optim.RMSprop}
_DEEPSPEED_ONLY_PARAMS = {"torch_adam", "adam_w_mode", "fused"}


@dataclass(frozen=True, kw_only=True)
class DSConfig:
    """What a pipeline job takes from a DeepSpeed config (batch sizes resolved for dp)."""

    train_batch_size: int
    """Samples per optimizer step over all data-parallel replicas."""
    micro_batch_size: int
    """Samples per microbatch on one replica (``train_micro_batch_size_per_gpu``)."""
    gradient_accumulation_steps: int
    """Microbatches per step: the pipeline's m."""
    optimizer: Mapping[str, Any] | None = None
    """``{"type": "Adam", "params": {...}}`` or None (the caller passes one)."""
    scheduler: Mapping[str, Any] | None = None
    """``{"type": "WarmupLR" | "WarmupDecayLR", "params": {...}}`` or None."""
    precision: str = "fp32"
    """'fp16' (``fp16.enabled``), 'bf16' (``bf16.enabled``) or 'fp32'."""
    initial_loss_scale: float = 2.0**16
    """fp16: 2 ** ``fp16.initial_scale_power``."""
    loss_scale_window: int = 1000
    gradient_clipping: float | None = None
    zero_stage: int = 0
    steps_per_print: int = 10
    ignored: tuple[str, ...] = field(default=())
    """Top-level keys present but not used by a pipeline job here."""


def _load(config: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    path = Path(config)
    try:
        loaded = json.loads(path.read_text())
    except OSError as error:
        raise PipelineConfigError(f"cannot read the DeepSpeed config {path}: {error}") from error
    except json.JSONDecodeError as error:
        raise PipelineConfigError(f"{path} is not JSON: {error}") from error
    if not isinstance(loaded, dict):
        raise PipelineConfigError(f"{path} must hold a JSON object, got {type(loaded).__name__}")
    return loaded


def _positive(raw: Mapping[str, Any], key: str) -> int | None:
    value = raw.get(key)
    if value is None or value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PipelineConfigError(f"{key} must be an int >= 1, got {value!r}")
    return value


def _batch_sizes(raw: Mapping[str, Any], dp: int) -> tuple[int, int, int]:
    """(train batch, micro batch, accumulation): DeepSpeed's rule, batch = micro · gas · dp."""
    batch, micro = _positive(raw, "train_batch_size"), _positive(
        raw, "train_micro_batch_size_per_gpu")
    gas = _positive(raw, "gradient_accumulation_steps")
    if batch is None and micro is None:
        raise PipelineConfigError("the DeepSpeed config needs train_batch_size or "
                                  "train_micro_batch_size_per_gpu")
    if batch is None:
        micro, gas = cast(int, micro), gas or 1
        return micro * gas * dp, micro, gas
    if micro is None:
        gas = gas or 1
        if batch % (gas * dp):
            raise PipelineConfigError(f"train_batch_size={batch} is not divisible by "
                                      f"gradient_accumulation_steps × dp = {gas} × {dp}")
        return batch, batch // (gas * dp), gas
    if gas is None:
        if batch % (micro * dp):
            raise PipelineConfigError(f"train_batch_size={batch} is not divisible by "
                                      f"train_micro_batch_size_per_gpu × dp = {micro} × {dp}")
        return batch, micro, batch // (micro * dp)
    if batch != micro * gas * dp:
        raise PipelineConfigError(
            f"train_batch_size={batch} must equal train_micro_batch_size_per_gpu × "
            f"gradient_accumulation_steps × dp = {micro} × {gas} × {dp} = {micro * gas * dp}; "
            "drop one of the three keys to have it derived")
    return batch, micro, gas


def read_ds_config(config: str | Path | Mapping[str, Any], *, data_parallel: int) -> DSConfig:
    """Read a DeepSpeed config (a JSON path or a dict) for a job with `data_parallel`
    replicas; every problem is a `PipelineConfigError` naming the key."""
    raw = _load(config)
    batch, micro, gas = _batch_sizes(raw, data_parallel)
    fp16, bf16 = dict(raw.get("fp16") or {}), dict(raw.get("bf16") or {})
    if fp16.get("enabled") and bf16.get("enabled"):
        raise PipelineConfigError("fp16.enabled and bf16.enabled are both true; choose one")
    zero = dict(raw.get("zero_optimization") or {})
    stage = zero.get("stage", 0)
    if stage not in (0, 1):
        raise PipelineConfigError(
            f"zero_optimization.stage={stage!r} with pipeline parallelism: only 0 or 1 (ZeRO-2/3 "
            "would communicate gradients every microbatch; DeepSpeed refuses them too)")
    clipping = raw.get("gradient_clipping")
    if clipping is not None and (not isinstance(clipping, int | float) or clipping < 0):
        raise PipelineConfigError(f"gradient_clipping must be a number >= 0, got {clipping!r}")
    for key in ("optimizer", "scheduler"):
        section = raw.get(key)
        if section is not None and not (isinstance(section, Mapping) and "type" in section):
            raise PipelineConfigError(f"{key} must be {{\"type\": ..., \"params\": {{...}}}}, got "
                                      f"{section!r}")
    power = fp16.get("initial_scale_power", 16)
    return DSConfig(
        train_batch_size=batch, micro_batch_size=micro, gradient_accumulation_steps=gas,
        optimizer=raw.get("optimizer"), scheduler=raw.get("scheduler"),
        precision="fp16" if fp16.get("enabled") else "bf16" if bf16.get("enabled") else "fp32",
        initial_loss_scale=2.0 ** power, loss_scale_window=int(fp16.get("loss_scale_window",
                                                                        1000)),
        gradient_clipping=float(clipping) if clipping else None, zero_stage=int(stage),
        steps_per_print=_positive(raw, "steps_per_print") or 10,
        ignored=tuple(sorted(set(raw) - _READ)))


def make_optimizer_factory(section: Mapping[str, Any]) -> OptimizerFactory:
    """``params -> optimizer`` for an ``optimizer`` section. DeepSpeed's "Adam" decouples
    weight decay (``adam_w_mode`` defaults to true), so it is torch's AdamW (Adam when
    ``adam_w_mode`` is false)."""
    kind = str(section["type"]).lower()
    params = dict(section.get("params") or {})
    if kind == "adam" and params.get("adam_w_mode", True) is False:
        cls: type[torch.optim.Optimizer] = torch.optim.Adam
    elif kind in _OPTIMIZERS:
        cls = _OPTIMIZERS[kind]
    else:
        raise PipelineConfigError(f"optimizer type {section['type']!r} is not available here; "
                                  f"use one of Adam, AdamW, SGD, Adagrad, RMSprop or pass "
                                  "initialize(optimizer=...)")
    kwargs = {key: value for key, value in params.items() if key not in _DEEPSPEED_ONLY_PARAMS}
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])

    def factory(parameters: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
        try:
            return cls(parameters, **kwargs)
        except TypeError as error:
            raise PipelineConfigError(f"optimizer {section['type']!r} params {kwargs}: "
                                      f"{error}; fix optimizer.params") from error
    return factory


class WarmupLR(torch.optim.lr_scheduler.LRScheduler):
    """DeepSpeed's WarmupLR / WarmupDecayLR: from ``warmup_min_lr`` to ``warmup_max_lr`` over
    ``warmup_num_steps`` (log or linear), then constant, or (with ``total_num_steps``)
    linearly down to 0 at the last step."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", total_num_steps: int | None = None) -> None:
        if warmup_type not in ("log", "linear"):
            raise PipelineConfigError(f"warmup_type must be 'log' or 'linear', got "
                                      f"{warmup_type!r}")
        self.min_lr, self.max_lr = float(warmup_min_lr), float(warmup_max_lr)
        self.warmup_steps = max(2, int(warmup_num_steps))
        self.warmup_type = warmup_type
        self.total_steps = total_num_steps
        super().__init__(optimizer)

    def _factor(self, step: int) -> float:
        if step < self.warmup_steps:
            if self.warmup_type == "log":
                return math.log(step + 1) / math.log(self.warmup_steps)
            return step / self.warmup_steps
        if self.total_steps is None:
            return 1.0
        left = self.total_steps - step
        return max(0.0, left / max(1.0, self.total_steps - self.warmup_steps))

    def get_lr(self) -> list[float]:  # type: ignore[override]
        lr = self.min_lr + (self.max_lr - self.min_lr) * self._factor(self.last_epoch)
        return [lr for _ in self.optimizer.param_groups]


def make_scheduler(section: Mapping[str, Any], optimizer: torch.optim.Optimizer
                   ) -> torch.optim.lr_scheduler.LRScheduler:
    """The learning-rate scheduler of a ``scheduler`` section (WarmupLR, WarmupDecayLR)."""
    kind = section["type"]
    params = dict(section.get("params") or {})
    if kind not in ("WarmupLR", "WarmupDecayLR"):
        raise PipelineConfigError(f"scheduler type {kind!r} is not available here; use WarmupLR "
                                  "or WarmupDecayLR, or pass initialize(lr_scheduler=...)")
    if kind == "WarmupDecayLR" and "total_num_steps" not in params:
        raise PipelineConfigError("WarmupDecayLR needs scheduler.params.total_num_steps")
    try:
        return WarmupLR(optimizer, **params)
    except TypeError as error:
        raise PipelineConfigError(f"scheduler {kind!r} params {params}: {error}") from error
