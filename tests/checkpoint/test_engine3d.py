"""Checkpoints through the 3D engine: ZeRO-1 with a tied embedding/head resumes exactly, and
the fp16 loss scaler's state comes back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline import PipelineEngine, PipelineModule, launch
from tests.support.engine3d_models import MODELS, OPTIMIZERS
from tests.support.equivalence import gathered_weights

pytestmark = pytest.mark.multiprocess


def _engine(model: str, **parallel: Any) -> PipelineEngine:
    spec = MODELS[model]
    module = PipelineModule(spec.layers(), num_stages=2, loss_fn=spec.loss, base_seed=7)
    return PipelineEngine(module, schedule="1f1b", num_microbatches=4,
                          optimizer=OPTIMIZERS["adam"], data_parallel=2, timeout=30, **parallel)


def _train(engine: PipelineEngine, model: str, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):  # the batch depends on the step only, so a resumed job sees the same
        inputs, targets = MODELS[model].batch(engine.global_step, 16)
        mine = slice(8 * engine.position.dp_rank, 8 * engine.position.dp_rank + 8)
        losses.append(engine.train_batch(inputs[mine], targets[mine]))
    return losses


def _rank(root: str, resume: bool) -> dict[str, Any]:
    zero = _engine("tied", zero_stage=1)
    scaled = _engine("mlp", precision="fp16", initial_loss_scale=2.0**10, loss_scale_window=1)
    if resume:
        zero.load_checkpoint(f"{root}/zero")
        scaled.load_checkpoint(f"{root}/fp16")
    else:
        _train(zero, "tied", 2)
        zero.save_checkpoint(f"{root}/zero")
        _train(scaled, "mlp", 2)
        scaled.save_checkpoint(f"{root}/fp16")
    scaler = scaled.loss_scaler.state_dict() if scaled.loss_scaler is not None else None
    return {"losses": _train(zero, "tied", 2), "weights": gathered_weights(zero),
            "step": zero.global_step, "scaler": scaler}


def test_zero1_tied_checkpoint_resumes_exactly_and_keeps_the_loss_scaler(tmp_path: Path) -> None:
    root = str(tmp_path)
    straight = launch(_rank, 4, root, False, timeout=60, join_timeout=240)
    resumed = launch(_rank, 4, root, True, timeout=60, join_timeout=240)
    assert resumed[0]["step"] == straight[0]["step"] == 4
    assert resumed[0]["losses"] == straight[0]["losses"]
    for key, value in straight[0]["weights"].items():
        assert torch.equal(resumed[0]["weights"][key], value), key
    assert straight[0]["scaler"] is not None
    assert [r["scaler"] for r in resumed] == [r["scaler"] for r in straight]
