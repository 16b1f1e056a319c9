"""An engine built under torchrun without a process group makes one from torchrun's
environment (as deepspeed.init_distributed does); without that environment it refuses."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import torch, torch.distributed as dist
from torch import nn
from pipeline import PipelineEngine, PipelineModule
from pipeline.model.layers import LayerSpec
assert not dist.is_initialized()
module = PipelineModule([LayerSpec(nn.Linear, 4, 4), LayerSpec(nn.Linear, 4, 4)],
                        num_stages=1, loss_fn=nn.functional.mse_loss)
engine = PipelineEngine(module, schedule="1f1b", num_microbatches=2, timeout=60,
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
loss = engine.train_batch(torch.ones(4, 4), torch.zeros(4, 4))
print("world", dist.get_world_size(), "rank", dist.get_rank(), "loss", loss > 0)
engine.stop_watchdog()
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    return subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=clean | {"PYTHONPATH": str(ROOT)} | env)


@pytest.mark.slow
def test_an_engine_under_torchrun_initialises_the_process_group_itself() -> None:
    done = _run({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "world 1 rank 0 loss True" in done.stdout


@pytest.mark.slow
def test_without_torchrun_s_environment_the_engine_still_refuses() -> None:
    done = _run({"RANK": "0", "WORLD_SIZE": "1"})  # no MASTER_ADDR / MASTER_PORT
    assert done.returncode != 0
    assert "no process group: run inside pipeline.launch" in done.stderr
