"""The DeepSpeed config keys a pipeline job uses, read once into a typed value (`DSConfig`).

Every key means what it means in DeepSpeed 0.19.8, defaults included: batch sizes (any two
of ``train_batch_size``, ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``
fix the third: batch = micro × accumulation × dp), ``gradient_clipping`` (default **1.0**:
DeepSpeed clips unless told 0), ``optimizer`` / ``scheduler`` (`pipeline.interop.ds_optimizers`),
``fp16`` / ``bf16``, ``zero_optimization.stage`` (≤ 1 with a pipeline), ``steps_per_print``
(default: never) and ``dataloader_drop_last`` (default false). A key this port does not
implement is refused by name, unless its value is DeepSpeed's default (then it means
nothing else here) or it only tunes DeepSpeed's communication (`DSConfig.no_effect`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from pipeline.errors import PipelineConfigError
from pipeline.interop.ds_optimizers import (
    WarmupDecayLR,
    WarmupLR,
    make_optimizer_factory,
    make_scheduler,
)

__all__ = ["DSConfig", "WarmupDecayLR", "WarmupLR", "make_optimizer_factory", "make_scheduler",
           "read_ds_config"]

_READ = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
         "optimizer", "scheduler", "fp16", "bf16", "gradient_clipping", "zero_optimization",
         "steps_per_print", "dataloader_drop_last"}
_DEFAULT_ONLY: dict[str, Any] = {
    "wall_clock_breakdown": False, "memory_breakdown": False, "prescale_gradients": False,
    "gradient_predivide_factor": 1.0, "gradient_allreduce_op": "mean", "dump_state": False,
    "disable_allgather": False, "communication_data_type": None,
    "zero_allow_untested_optimizer": False}
"""Top-level keys accepted only at DeepSpeed's default value (what this port does)."""
_FP16_DEFAULT_ONLY: dict[str, Any] = {"auto_cast": False, "loss_scale": 0, "min_loss_scale": 1,
                                      "consecutive_hysteresis": False,
                                      "fp16_master_weights_and_grads": False}
_ZERO_NO_EFFECT = {"reduce_bucket_size", "allgather_bucket_size", "overlap_comm",
                   "contiguous_gradients", "reduce_scatter", "allgather_partitions",
                   "round_robin_gradients", "use_multi_rank_bucket_allreduce"}
"""ZeRO keys that only tune how DeepSpeed communicates, not what it computes."""


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
    """``{"type": "WarmupLR" | "WarmupDecayLR" | a torch scheduler, "params": {...}}``."""
    precision: str = "fp32"
    """'fp16' (``fp16.enabled``), 'bf16' (``bf16.enabled``) or 'fp32'."""
    initial_loss_scale: float = 2.0**16
    """fp16: 2 ** ``fp16.initial_scale_power``."""
    loss_scale_window: int = 1000
    gradient_clipping: float | None = 1.0
    """Global gradient-norm clip (DeepSpeed's default 1.0; None when the config says 0)."""
    zero_stage: int = 0
    steps_per_print: int | None = None
    """Print the loss every this many steps (DeepSpeed's default: never)."""
    dataloader_drop_last: bool = False
    """Drop the last, short microbatch of the training data (DeepSpeed's default: keep it)."""
    no_effect: tuple[str, ...] = field(default=())
    """Keys accepted that only tune DeepSpeed's communication (nothing computed changes)."""


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
    if value is None:
        return None
    if value == "auto":  # the HF Trainer fills these in; DeepSpeed itself cannot read them
        raise PipelineConfigError(f"{key}=\"auto\" is the Hugging Face Trainer's placeholder; "
                                  "give a number")
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


def _refuse_unknown(section: Mapping[str, Any], where: str, known: set[str],
                    default_only: Mapping[str, Any]) -> list[str]:
    """Problems for keys of `section` this port does not implement (at a non-default value)."""
    problems = []
    for key, value in section.items():
        if key in known:
            continue
        if key in default_only:
            if value != default_only[key]:
                problems.append(f"{where}{key}={value!r} (only DeepSpeed's default "
                                f"{default_only[key]!r} is available here)")
            continue
        problems.append(f"{where}{key}")
    return problems


def _section(raw: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise PipelineConfigError(f"{key} must be a JSON object, got {value!r}")
    return dict(value)


def read_ds_config(config: str | Path | Mapping[str, Any], *, data_parallel: int) -> DSConfig:
    """Read a DeepSpeed config (a JSON path or a dict) for a job with `data_parallel`
    replicas; every problem is a `PipelineConfigError` naming the key."""
    raw = _load(config)
    problems = _refuse_unknown(raw, "", _READ, _DEFAULT_ONLY)
    fp16, bf16 = _section(raw, "fp16"), _section(raw, "bf16")
    zero = _section(raw, "zero_optimization")
    if fp16.get("enabled"):
        problems += _refuse_unknown(fp16, "fp16.", {"enabled", "initial_scale_power",
                                                    "loss_scale_window", "hysteresis"},
                                    _FP16_DEFAULT_ONLY)
        if fp16.get("hysteresis", 2) != 1:
            # DeepSpeed keeps the scale through the first `hysteresis` - 1 overflows; our
            # scaler backs off on every overflow, which is DeepSpeed's hysteresis 1
            problems.append(f"fp16.hysteresis={fp16.get('hysteresis', 2)!r} (DeepSpeed's "
                            "default is 2; only \"hysteresis\": 1 is available here: the scale "
                            "backs off at every overflow)")
    if bf16.get("enabled"):
        problems += _refuse_unknown(bf16, "bf16.", {"enabled"}, {})
    problems += _refuse_unknown(zero, "zero_optimization.", {"stage"} | _ZERO_NO_EFFECT, {})
    for key in ("optimizer", "scheduler"):
        section = raw.get(key)
        if section is None:
            continue
        if not (isinstance(section, Mapping) and "type" in section):
            raise PipelineConfigError(f"{key} must be {{\"type\": ..., \"params\": {{...}}}}, "
                                      f"got {section!r}")
        problems += _refuse_unknown(section, f"{key}.", {"type", "params"}, {})
    if problems:
        raise PipelineConfigError(
            "DeepSpeed config keys not available in this port (they would change what is "
            "trained; remove them or set DeepSpeed's default): " + "; ".join(problems))
    batch, micro, gas = _batch_sizes(raw, data_parallel)
    if fp16.get("enabled") and bf16.get("enabled"):
        raise PipelineConfigError("fp16.enabled and bf16.enabled are both true; choose one")
    stage = zero.get("stage", 0)
    if stage not in (0, 1):
        raise PipelineConfigError(
            f"zero_optimization.stage={stage!r} with pipeline parallelism: only 0 or 1 (ZeRO-2/3 "
            "would communicate gradients every microbatch; DeepSpeed refuses them too)")
    clipping = raw.get("gradient_clipping", 1.0)
    if isinstance(clipping, bool) or not isinstance(clipping, int | float) or clipping < 0:
        raise PipelineConfigError(f"gradient_clipping must be a number >= 0 (0: no clipping), "
                                  f"got {clipping!r}")
    drop_last = raw.get("dataloader_drop_last", False)
    if not isinstance(drop_last, bool):
        raise PipelineConfigError(f"dataloader_drop_last must be true or false, got "
                                  f"{drop_last!r}")
    return DSConfig(
        train_batch_size=batch, micro_batch_size=micro, gradient_accumulation_steps=gas,
        optimizer=raw.get("optimizer"), scheduler=raw.get("scheduler"),
        precision="fp16" if fp16.get("enabled") else "bf16" if bf16.get("enabled") else "fp32",
        initial_loss_scale=2.0 ** fp16.get("initial_scale_power", 16),
        loss_scale_window=int(fp16.get("loss_scale_window", 1000)),
        gradient_clipping=float(clipping) if clipping > 0 else None, zero_stage=int(stage),
        steps_per_print=_positive(raw, "steps_per_print"), dataloader_drop_last=drop_last,
        no_effect=tuple(sorted(f"zero_optimization.{key}" for key in zero
                               if key in _ZERO_NO_EFFECT)))
