"""The DeepSpeed config keys a pipeline job reads: batch sizes, optimizer, scheduler, precision."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.errors import PipelineConfigError
from pipeline.interop.ds_config import (
    WarmupLR,
    make_optimizer_factory,
    make_scheduler,
    read_ds_config,
)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.integers(1, 8), st.integers(1, 4),
       st.sets(st.sampled_from(["batch", "micro", "gas"]), min_size=1))
def test_any_two_batch_keys_fix_the_third(micro: int, gas: int, dp: int,
                                          given_keys: set[str]) -> None:
    if given_keys == {"gas"}:
        given_keys = {"gas", "micro"}
    raw = {"batch": ("train_batch_size", micro * gas * dp),
           "micro": ("train_micro_batch_size_per_gpu", micro),
           "gas": ("gradient_accumulation_steps", gas)}
    config = dict(raw[key] for key in given_keys)
    resolved = read_ds_config(config, data_parallel=dp)
    assert resolved.train_batch_size == resolved.micro_batch_size * \
        resolved.gradient_accumulation_steps * dp
    if given_keys >= {"micro", "gas"} or given_keys >= {"batch", "micro"}:
        assert (resolved.micro_batch_size, resolved.gradient_accumulation_steps) == (micro, gas)


def test_inconsistent_batch_keys_name_the_product() -> None:
    with pytest.raises(PipelineConfigError, match=r"2 × 4 × 2 = 16"):
        read_ds_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2,
                        "gradient_accumulation_steps": 4}, data_parallel=2)


def test_zero_stage_two_is_refused_with_the_reason() -> None:
    with pytest.raises(PipelineConfigError, match=r"zero_optimization.stage=2.*only 0 or 1"):
        read_ds_config({"train_batch_size": 8, "zero_optimization": {"stage": 2}},
                       data_parallel=1)


def test_file_config_reads_every_pipeline_key(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
        "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
        "gradient_clipping": 0.5, "zero_optimization": {"stage": 1, "overlap_comm": True},
        "steps_per_print": 5, "dataloader_drop_last": True, "wall_clock_breakdown": False}))
    config = read_ds_config(path, data_parallel=2)
    assert (config.gradient_accumulation_steps, config.precision, config.initial_loss_scale,
            config.gradient_clipping, config.zero_stage, config.steps_per_print,
            config.dataloader_drop_last) == (4, "fp16", 256.0, 0.5, 1, 5, True)
    assert config.no_effect == ("zero_optimization.overlap_comm",)


def test_deepspeed_defaults_when_keys_are_absent() -> None:
    """Regression: no clipping, a print every 10 steps; DeepSpeed 0.19.8 clips at 1.0
    (GRADIENT_CLIPPING_DEFAULT), never prints (STEPS_PER_PRINT_DEFAULT None) and keeps the
    last short microbatch (DATALOADER_DROP_LAST_DEFAULT False)."""
    config = read_ds_config({"train_batch_size": 8}, data_parallel=2)
    assert (config.micro_batch_size, config.gradient_accumulation_steps) == (4, 1)
    assert (config.gradient_clipping, config.steps_per_print, config.dataloader_drop_last,
            config.precision, config.zero_stage) == (1.0, None, False, "fp32", 0)
    assert read_ds_config({"train_batch_size": 8, "gradient_clipping": 0},
                          data_parallel=1).gradient_clipping is None


@pytest.mark.parametrize(("extra", "named"), [
    ({"prescale_gradients": True}, "prescale_gradients=True"),
    ({"activation_checkpointing": {"partition_activations": True}}, "activation_checkpointing"),
    ({"fp16": {"enabled": True}}, "fp16.hysteresis=2"),
    ({"fp16": {"enabled": True, "hysteresis": 1, "loss_scale": 128}}, "fp16.loss_scale=128"),
    ({"bf16": {"enabled": True, "immediate_grad_update": True}}, "bf16.immediate_grad_update"),
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.offload_optimizer"),
    ({"optimizer": {"type": "Adam", "params": {}, "legacy_fusion": True}},
     "optimizer.legacy_fusion"),
    ({"train_micro_batch_size_per_gpu": "auto"}, "placeholder"),
])
def test_unsupported_keys_are_refused_by_name(extra: dict[str, Any], named: str) -> None:
    """Regression: keys we do not implement were listed as ignored and training went on."""
    with pytest.raises(PipelineConfigError, match=re.escape(named)):
        read_ds_config({"train_batch_size": 8, **extra}, data_parallel=1)


def test_keys_at_deepspeeds_default_value_are_accepted() -> None:
    read_ds_config({"train_batch_size": 8, "prescale_gradients": False,
                    "wall_clock_breakdown": False, "fp16": {"enabled": False, "x": 1}},
                   data_parallel=1)


def _built(section: dict[str, Any]) -> torch.optim.Optimizer:
    return make_optimizer_factory(section)([torch.nn.Parameter(torch.zeros(2))])


# From DeepSpeed 0.19.8's `_configure_basic_optimizer` / `get_optimizer_configuration` and
# FusedAdam's signature: (type, params) -> (torch class, the settings of its update)
ADAM_CASES = [
    ("Adam", {}, torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.0, "eps": 1e-8}),
    ("adam", {"adam_w_mode": False, "weight_decay": 0.1}, torch.optim.Adam,
     {"weight_decay": 0.1}),
    ("AdamW", {"adam_w_mode": False}, torch.optim.AdamW, {"weight_decay": 0.0}),
    ("Adam", {"torch_adam": True}, torch.optim.AdamW, {"weight_decay": 0.01}),  # torch's
    ("Adam", {"torch_adam": True, "adam_w_mode": False}, torch.optim.Adam,
     {"weight_decay": 0.0}),
    ("Adam", {"lr": 0.5, "betas": [0.8, 0.9]}, torch.optim.AdamW,
     {"lr": 0.5, "betas": (0.8, 0.9), "weight_decay": 0.0}),
]


@pytest.mark.parametrize(("kind", "params", "cls", "settings"), ADAM_CASES)
def test_adam_sections_build_deepspeeds_update(kind: str, params: dict[str, Any], cls: type,
                                               settings: dict[str, Any]) -> None:
    """Regression: "Adam" without weight_decay became AdamW with torch's 0.01."""
    optimizer = _built({"type": kind, "params": params})
    assert type(optimizer) is cls
    group = optimizer.param_groups[0]
    assert {key: group[key] for key in settings} == settings


def test_other_optimizers_are_looked_up_in_torch_as_written() -> None:
    assert type(_built({"type": "SGD", "params": {"lr": 0.1}})) is torch.optim.SGD
    assert type(_built({"type": "Adagrad"})) is torch.optim.Adagrad
    with pytest.raises(PipelineConfigError, match=r"'sgd'.*as written: 'SGD'"):
        make_optimizer_factory({"type": "sgd"})
    with pytest.raises(PipelineConfigError, match="'Lamb' is DeepSpeed's own"):
        make_optimizer_factory({"type": "Lamb"})
    with pytest.raises(PipelineConfigError, match="gradient_clipping"):
        make_optimizer_factory({"type": "Adam", "params": {"max_grad_norm": 1.0}})
    with pytest.raises(PipelineConfigError, match=r"\['foo'\] are not parameters"):
        make_optimizer_factory({"type": "Adam", "params": {"foo": 1}})


def test_unknown_optimizer_names_the_available_ones() -> None:
    with pytest.raises(PipelineConfigError, match=r"OneBitAdam.*Adam, AdamW, Adagrad"):
        make_optimizer_factory({"type": "OneBitAdam"})


def _deepspeed_warmup_lrs(steps: int, *, min_lr: float, max_lr: float, warmup: int,
                          kind: str, total: int | None) -> list[float]:
    """The oracle, from DeepSpeed's WarmupLR / WarmupDecayLR: iteration starts at -1 (the
    minimum), and advances after each optimizer step; the lr each step runs with."""
    warmup = max(2, warmup)
    rates = []
    for iteration in range(-1, steps - 1):
        if iteration < 0:
            gamma = 0.0
        elif iteration < warmup:
            gamma = math.log(iteration + 1) / math.log(warmup) if kind == "log" \
                else iteration / warmup
        elif total is None:
            gamma = 1.0
        else:
            gamma = max(0.0, (total - iteration) / max(1.0, total - warmup))
        rates.append(min_lr + (max_lr - min_lr) * gamma)
    return rates


@pytest.mark.parametrize(("kind", "total"), [("linear", 8), ("log", 8), ("log", None),
                                             ("linear", None)])
def test_warmup_schedules_follow_deepspeeds_step_count(kind: str, total: int | None) -> None:
    """Regression: the warm-up ran one step ahead of DeepSpeed's (which starts at -1)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.3)
    params: dict[str, Any] = {"warmup_min_lr": 0.01, "warmup_num_steps": 4,
                              "warmup_type": kind}
    if total is not None:
        params.update(total_num_steps=total, warmup_max_lr=0.1)
    scheduler = make_scheduler({"type": "WarmupDecayLR" if total else "WarmupLR",
                                "params": params}, optimizer)
    assert isinstance(scheduler, WarmupLR)
    rates = []
    for _ in range(11):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    # WarmupLR's maximum defaults to the optimizer's lr (0.3), WarmupDecayLR's to 0.001
    assert rates == pytest.approx(_deepspeed_warmup_lrs(
        11, min_lr=0.01, max_lr=0.1 if total else 0.3, warmup=4, kind=kind, total=total))
    assert rates[0] == rates[1] == pytest.approx(0.01)


def test_warmup_schedules_equal_deepspeeds_own() -> None:
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    for kind, params in (("WarmupLR", {"warmup_num_steps": 3, "warmup_min_lr": 0.02}),
                         ("WarmupDecayLR", {"warmup_num_steps": 3, "total_num_steps": 7,
                                            "warmup_type": "linear"})):
        ours_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.2)
        theirs_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.2)
        ours = make_scheduler({"type": kind, "params": params}, ours_opt)
        theirs = getattr(lr_schedules, kind)(theirs_opt, **params)
        for _ in range(9):
            assert ours_opt.param_groups[0]["lr"] == pytest.approx(
                theirs_opt.param_groups[0]["lr"]), kind
            ours_opt.step()
            theirs_opt.step()
            ours.step()
            theirs.step()


def test_torch_schedulers_are_taken_by_name_and_deepspeed_only_ones_refused() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = make_scheduler({"type": "StepLR", "params": {"step_size": 2}}, optimizer)
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR)
    with pytest.raises(PipelineConfigError, match="'OneCycle' is not available"):
        make_scheduler({"type": "OneCycle", "params": {}}, optimizer)
