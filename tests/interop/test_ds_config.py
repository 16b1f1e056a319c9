"""The DeepSpeed config keys a pipeline job reads: batch sizes, optimizer, scheduler, precision."""

from __future__ import annotations

import json
from pathlib import Path

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
        "fp16": {"enabled": True, "initial_scale_power": 8}, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 1}, "steps_per_print": 5,
        "wall_clock_breakdown": False}))
    config = read_ds_config(path, data_parallel=2)
    assert (config.gradient_accumulation_steps, config.precision, config.initial_loss_scale,
            config.gradient_clipping, config.zero_stage, config.steps_per_print) == \
        (4, "fp16", 256.0, 1.0, 1, 5)
    assert config.ignored == ("wall_clock_breakdown",)
    optimizer = make_optimizer_factory(config.optimizer or {})([torch.nn.Parameter(
        torch.zeros(2))])
    assert isinstance(optimizer, torch.optim.AdamW)  # DeepSpeed's Adam: adam_w_mode=True


def test_unknown_optimizer_names_the_available_ones() -> None:
    with pytest.raises(PipelineConfigError, match=r"OneBitAdam.*Adam, AdamW, SGD"):
        make_optimizer_factory({"type": "OneBitAdam"})


def test_warmup_lr_climbs_then_decays() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = make_scheduler({"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 4,
        "warmup_type": "linear", "total_num_steps": 8}}, optimizer)
    assert isinstance(scheduler, WarmupLR)
    rates = []
    for _ in range(9):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates == pytest.approx([0.0, 0.025, 0.05, 0.075, 0.1, 0.075, 0.05, 0.025, 0.0])
