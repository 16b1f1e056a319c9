"""An engine built under torchrun without a process group makes one from torchrun's
environment (as deepspeed.init_distributed does); without that environment it refuses."""

from __future__ import annotations

import os
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
import os, sys
# one write of one line: two ranks share this stdout, and print's separate writes interleaved
os.write(sys.stdout.fileno(),
         f"world {dist.get_world_size()} rank {dist.get_rank()} loss {loss > 0}\\n".encode())
engine.stop_watchdog()
dist.destroy_process_group()
"""


def _run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    return subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=clean | {"PYTHONPATH": str(ROOT)} | env)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_an_engine_under_torchrun_initialises_the_process_group_itself(tmp_path: Path) -> None:
    script = tmp_path / "train.py"  # a user's script: no init_process_group, no cleanup
    script.write_text(_SCRIPT.replace("num_stages=1", "num_stages=2").split(
        "engine.stop_watchdog()")[0])
    done = subprocess.run(["torchrun", "--standalone", "--nproc-per-node", "2", str(script)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(done.stdout.split("\n"))[-2:] == ["world 2 rank 0 loss True",
                                                     "world 2 rank 1 loss True"]


@pytest.mark.slow
def test_without_torchrun_s_environment_the_engine_still_refuses() -> None:
    done = _run({"RANK": "0", "WORLD_SIZE": "1"})  # no MASTER_ADDR / MASTER_PORT
    assert done.returncode != 0
    assert "no process group: run inside pipeline.launch" in done.stderr
