"""Checkpoints move between ZeRO stages: a ZeRO-3 (or ZeRO-2) checkpoint of Adam state loads
at ZeRO-1 and a ZeRO-1 one at ZeRO-3, and the next step equals the uninterrupted run's; its
weights alone load at ZeRO-3 as at ZeRO-1 (pp2 × dp2, tied embedding / head)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pipeline import PipelineEngine, PipelineModule, launch
from tests.support.engine3d_models import MODELS

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

BATCH = 16
PAIRS = [(3, 1), (1, 3), (2, 3)]
"""(ZeRO stage that saves, ZeRO stage that loads)."""


def _engine(zero_stage: int) -> tuple[PipelineEngine, PipelineModule]:
    model = MODELS["tied"]
    module = PipelineModule(model.layers(), num_stages=2, loss_fn=model.loss)
    engine = PipelineEngine(module, schedule="1f1b", num_microbatches=4, timeout=60,
                            data_parallel=2, zero_stage=zero_stage, bucket_mb=2**-12,
                            optimizer=lambda p: torch.optim.Adam(p, lr=0.01))
    return engine, module


def _train(engine: PipelineEngine, step: int) -> None:
    inputs, targets = MODELS["tied"].batch(step, BATCH)
    rows = slice(engine.position.dp_rank * BATCH // 2, (engine.position.dp_rank + 1) * BATCH // 2)
    engine.train_batch(inputs[rows], targets[rows])


def _weights(engine: PipelineEngine, module: PipelineModule) -> dict[Any, torch.Tensor]:
    engine.finish_param_gather()
    return {key: p.detach().clone() for key, p in module.named_layer_parameters()}


def _resumed_steps(root: str) -> list[float]:
    """Per pair, the largest |weight difference| after step 1 between the run that saved
    after step 0 and kept going and the one that loaded that checkpoint at another stage."""
    errors = []
    for saving, loading in PAIRS:
        directory = f"{root}/{saving}to{loading}"
        first, module = _engine(saving)
        torch.manual_seed(0)
        _train(first, 0)
        first.save_checkpoint(directory)
        _train(first, 1)
        expected = _weights(first, module)
        second, module = _engine(loading)
        second.load_checkpoint(directory)
        _train(second, 1)
        got = _weights(second, module)
        errors.append(max(float((got[key] - expected[key]).abs().max()) for key in expected))
        dist.barrier()
    # weights only (fresh Adam state): ZeRO-3 must take the loaded weights into its masters
    runs = []
    for zero_stage in (1, 3):
        engine, module = _engine(zero_stage)
        engine.load_checkpoint(f"{root}/1to3", load_optimizer=False)
        _train(engine, 1)
        runs.append(_weights(engine, module))
    errors.append(max(float((runs[1][key] - runs[0][key]).abs().max()) for key in runs[0]))
    return errors


def test_checkpoints_reshard_across_zero_stages(tmp_path: Path) -> None:
    for errors in launch(_resumed_steps, 4, str(tmp_path), timeout=60, join_timeout=600):
        assert max(errors) < 1e-6, dict(zip([*PAIRS, "weights only"], errors))
