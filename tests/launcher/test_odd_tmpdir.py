"""Paths are paths: a TMPDIR holding '#', '?' and a newline carries launch, save and resume
(the rendezvous was a file:// URL, which such a path ends early or bends)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

_REPO = str(Path(__file__).resolve().parents[2])

_SCRIPT = """
import os, sys, tempfile
import torch
import torch.distributed as dist
from pipeline import launch
from pipeline.checkpoint.load import load_checkpoint
from pipeline.checkpoint.root_lock import release_root
from pipeline.checkpoint.save import save_checkpoint
from tests.support.checkpoint_cases import Job


def total() -> float:
    value = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(value)
    return float(value)


if __name__ == "__main__":
    print(launch(total, 2, timeout=60), launch(total, 2, timeout=60), flush=True)
    root = tempfile.mkdtemp()
    job = Job()
    job.train(1)
    save_checkpoint(root, job.parts())
    release_root(root)
    print("resumed", load_checkpoint(root, Job(base_seed=3).parts()).step, flush=True)
"""


@pytest.mark.multiprocess
@pytest.mark.slow
def test_launch_save_and_resume_under_a_tmpdir_with_hash_question_mark_and_newline(
        tmp_path: Path) -> None:
    # regression: with '#' or '?' the rendezvous escaped to a shorter path, went stale and
    # later launches failed ("Connection refused") or hung; with a newline launch hung
    # short, under /tmp: the fork server's socket path must fit AF_UNIX's 108 bytes
    odd = Path(tempfile.mkdtemp(prefix=f"ps{os.getpid()}#d?x=1\ne", dir="/tmp"))
    try:
        _launch_save_resume(odd, tmp_path)
    finally:
        shutil.rmtree(odd, ignore_errors=True)


def _launch_save_resume(odd: Path, tmp_path: Path) -> None:
    cut = odd.parent / odd.name.split("#")[0]  # where a file:// URL of it ends
    cut.write_bytes(b"the rendezvous a killed earlier run left there")  # stale
    script = tmp_path / "job.py"  # a file: the ranks import `total` from it
    script.write_text(_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=150, cwd=_REPO,
                          env={**os.environ, "TMPDIR": str(odd), "PYTHONPATH": _REPO})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["[3.0, 3.0] [3.0, 3.0]", "resumed 1"], done.stdout
    assert "Traceback" not in done.stderr
    leftovers = [name for name in os.listdir(odd) if name.startswith(("pipesched-", "pymp-"))]
    assert not leftovers
    assert cut.read_bytes() == b"the rendezvous a killed earlier run left there"
    cut.unlink()
