"""DeepSpeed's API on our engine: initialize with a ds_config dict and training data, then
train_batch() with no arguments; DeepSpeed's AlexNet example runs with its imports changed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import pipeline
from pipeline import LayerSpec, PipelineModule
from pipeline.errors import PipelineConfigError
from pipeline.model.reference import build_reference, reference_forward
from tests.support.equivalence import gathered_weights
from tests.support.rank_harness import run_ranks

ROOT = Path(__file__).resolve().parents[2]


def _layers() -> list[object]:
    return [LayerSpec(nn.Linear, 6, 8), nn.ReLU(inplace=True), LayerSpec(nn.Linear, 8, 3)]


def _check_initialize(rank: int, world_size: int, directory: str) -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 6), torch.randint(0, 3, (64,)))
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.1,
                                                            "warmup_num_steps": 3}},
              "steps_per_print": 100}
    module = PipelineModule(layers=_layers(), num_stages=2, loss_fn=nn.CrossEntropyLoss())
    engine, optimizer, loader, scheduler = pipeline.initialize(
        model=module, config=config, training_data=data)
    assert engine.gradient_accumulation_steps() == 4 and loader is not None
    assert optimizer is engine.optimizer and scheduler is engine.lr_scheduler
    # train_batch(data_iter) equals the single-process model on the same microbatches
    reference = build_reference(_layers())
    inputs, labels = data.tensors[0][:8], data.tensors[1][:8]
    pairs = iter([(inputs[k * 2:(k + 1) * 2], labels[k * 2:(k + 1) * 2]) for k in range(4)])
    loss = engine.train_batch(data_iter=pairs)
    expected = F.cross_entropy(reference_forward(reference, inputs), labels)
    assert abs(float(loss) - float(expected)) < 1e-5
    # then with no arguments, from the training data; the scheduler steps once per step
    lrs = [engine.get_lr()[0]]
    for _ in range(3):
        assert torch.isfinite(engine.train_batch())
        lrs.append(engine.get_lr()[0])
    assert engine.global_steps == 4
    # DeepSpeed's log warm-up over 3 steps: its iteration starts at -1, so steps 1 and 2 run
    # at warmup_min_lr (0): the lr after step k (the lr of step k + 1) is iteration k - 1's
    assert lrs == pytest.approx([0.0, 0.1 * 0.6309298, 0.1, 0.1])
    pairs = iter([(inputs[k * 4:(k + 1) * 4], labels[k * 4:(k + 1) * 4]) for k in range(2)])
    loss, logits = engine.eval_batch(pairs, return_logits=True, num_micro_batches=2)
    trained = build_reference(_layers())
    with torch.no_grad():
        for (layer, name), value in gathered_weights(engine.engine).items():
            dict(trained[layer].named_parameters())[name].copy_(value)
        expected_logits = reference_forward(trained, inputs)
    torch.testing.assert_close(logits, expected_logits)  # on every rank
    assert abs(float(loss) - float(F.cross_entropy(expected_logits, labels))) < 1e-5
    with pytest.raises(PipelineConfigError, match="train_batch"):
        engine(inputs)
    engine.save_checkpoint(directory, client_state={"epoch": 3})
    path, client = engine.load_checkpoint(directory)
    assert client == {"epoch": 3} and engine.global_steps == 4
    assert Path(path).name == "step_000004"


@pytest.mark.multiprocess
def test_initialize_reads_the_config_and_trains_from_its_data(tmp_path: Path) -> None:
    run_ranks(_check_initialize, 2, str(tmp_path))


def test_initialize_needs_a_pipeline_module() -> None:
    with pytest.raises(TypeError, match="PipelineModule"):
        pipeline.initialize(model=nn.Linear(2, 2), config={"train_batch_size": 2})


@pytest.mark.multiprocess
@pytest.mark.slow
def test_deepspeed_alexnet_example_runs_with_its_imports_changed(tmp_path: Path) -> None:
    """DeepSpeed's example unchanged but for imports: its `parameters` cut puts an in-place
    ReLU first on stage 1 (it failed here before received inputs were cloned)."""
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({
        "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.001}}, "steps_per_print": 1}))
    torchrun = shutil.which("torchrun")
    command = ([torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]) + [
        "--standalone", "--nproc_per_node", "2",
        str(ROOT / "examples" / "deepspeed_alexnet" / "train.py"),
        "--deepspeed_config", str(config), "-p", "2", "--steps", "2", "--backend", "gloo"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), SYNTHETIC_IMAGE_SIZE="64",
               SYNTHETIC_SAMPLES="32", OMP_NUM_THREADS="1")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "steps: 2 loss:" in done.stdout, done.stdout
