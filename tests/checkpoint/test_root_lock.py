"""One writing job per checkpoint root: a second writer is refused naming the root and the
holder's pid, and the root is free again as soon as the holder dies (however it dies)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pipeline import PipelineEngine, PipelineModule, launch
from pipeline.checkpoint.manifest import LATEST, read_manifest
from pipeline.checkpoint.root_lock import (
    LOCK_NAME,
    CheckpointRootLockedError,
    held_roots,
    lock_root,
    release_root,
)
from pipeline.checkpoint.save import save_checkpoint
from tests.support.checkpoint_cases import Job
from tests.support.pipeline_models import MODELS

_REPO = str(Path(__file__).resolve().parents[2])  # this checkout's pipeline, not an install
WAIT = 300.0  # seconds any rank waits for the other job before failing (never a hang)

_HOLDER = ("import sys, time\n"
           "from pipeline.checkpoint.root_lock import lock_root\n"
           "lock_root(sys.argv[1])\n"
           "print('held', flush=True)\n"
           "time.sleep(600)\n")


def _start_holder(root: Path) -> subprocess.Popen[str]:
    """Another process that takes `root` and keeps it until killed."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(root)], text=True,
                              stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": _REPO})
    assert holder.stdout is not None
    line = holder.stdout.readline()  # returns at 'held' or when the process ends
    if line.strip() != "held":
        holder.kill()
        pytest.fail(f"the holder process did not take the lock (exit {holder.wait(60)})")
    return holder


def test_a_second_writer_is_refused_naming_the_root_and_the_holder_pid(tmp_path: Path) -> None:
    holder = _start_holder(tmp_path)
    try:
        with pytest.raises(CheckpointRootLockedError) as caught:
            lock_root(str(tmp_path))
        error = caught.value
        assert (error.root, error.holder_pid) == (str(tmp_path), holder.pid)
        assert str(tmp_path) in str(error) and f"process {holder.pid}" in str(error)
        assert error.path == str(tmp_path / LOCK_NAME)
        job = Job()
        with pytest.raises(CheckpointRootLockedError, match=f"held by process {holder.pid}"):
            save_checkpoint(str(tmp_path), job.parts())
        assert sorted(os.listdir(tmp_path)) == [LOCK_NAME]  # refused before writing anything
    finally:
        holder.kill()  # SIGKILL: no cleanup runs in the holder
        holder.wait(60)
    try:  # the kernel dropped the dead holder's lock: this process takes the root
        save_checkpoint(str(tmp_path), Job().parts())
        assert (tmp_path / LATEST).read_text().strip() == "step_000000"
    finally:
        release_root(str(tmp_path))


def test_a_process_holding_the_root_saves_again_and_can_release_it(tmp_path: Path) -> None:
    job = Job()
    try:
        save_checkpoint(str(tmp_path), job.parts())
        job.train(1)
        save_checkpoint(str(tmp_path), job.parts())  # the lock is this process's already
    finally:
        release_root(str(tmp_path))
    holder = _start_holder(tmp_path)  # released: another process can take it
    holder.kill()
    holder.wait(60)


def test_a_forked_child_does_not_keep_the_root(tmp_path: Path) -> None:
    """A child forked by the holder (a DataLoader worker) closes its copy of the lock, so the
    root goes free when the holder lets go (or dies) while the child lives on."""
    lock_root(str(tmp_path))
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # only plain Python here, then _exit: nothing of pytest runs twice
        os.close(write_end)
        os.read(read_end, 1)  # returns once the parent closes its end
        os._exit(0 if held_roots() == [] else 1)
    os.close(read_end)
    try:
        release_root(str(tmp_path))
        holder = _start_holder(tmp_path)  # fails if the living child still held the lock
        holder.kill()
        holder.wait(60)
    finally:
        os.close(write_end)
        _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0


# -- two concurrent jobs (processes) on one root -------------------------------------------


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


def _engine() -> PipelineEngine:
    module = PipelineModule(MODELS["mlp"].layers(), num_stages=2, loss_fn=MODELS["mlp"].loss)
    return PipelineEngine(module, schedule="1f1b", num_microbatches=2, optimizer=_sgd,
                          timeout=WAIT)


def _wait_for(path: Path, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not path.exists():
        if Path(path.parent, _FIRST_FAILED).exists():
            raise RuntimeError(f"gave up waiting for {what}: the first job failed")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {WAIT:.0f} s ({path} is missing)")
        time.sleep(0.05)


_FIRST_FAILED = "first_failed"  # in the gate folder: the first job raised, nobody waits for it


def _run_first_job(root: str, gate: str) -> list[dict[str, Any]]:
    try:
        return launch(_first_job, 2, root, gate, timeout=WAIT, join_timeout=2 * WAIT)
    except BaseException:
        Path(gate, _FIRST_FAILED).touch()
        raise


def _first_job(root: str, gate: str) -> dict[str, Any]:
    """Saves step 1, then pauses its step-2 save after every rank's files are in the staging
    directory (the moment the other job's sweep used to delete them) until the other job
    has tried to save."""
    engine = _engine()
    engine.train_batch(*MODELS["mlp"].batch(seed=0, batch=8))
    engine.save_checkpoint(root)
    engine.train_batch(*MODELS["mlp"].batch(seed=1, batch=8))
    if dist.get_rank() == 0:
        def pause() -> None:
            Path(gate, "first_paused").touch()
            _wait_for(Path(gate, "second_tried"), "the second job's save")
        engine.faults.arm("checkpoint.manifest", pause)
    info = engine.save_checkpoint(root)
    return {"pid": os.getpid(), "directory": info.directory}


def _second_job(root: str, gate: str) -> dict[str, Any]:
    """Tries to save into the root while the first job's save is in progress."""
    try:
        engine = _engine()
        _wait_for(Path(gate, "first_paused"), "the first job's pause")
        try:
            engine.save_checkpoint(root)
        except CheckpointRootLockedError as error:
            return {"refused": str(error), "pid": error.holder_pid, "root": error.root}
        return {"refused": None}
    finally:
        dist.barrier()  # both ranks have tried before the first job goes on
        if dist.get_rank() == 0:
            Path(gate, "second_tried").touch()


def _third_job(root: str) -> str:
    engine = _engine()
    engine.train_batch(*MODELS["mlp"].batch(seed=0, batch=8))
    return engine.save_checkpoint(root).directory


@pytest.mark.multiprocess
def test_a_second_job_cannot_sweep_away_a_save_in_progress(tmp_path: Path) -> None:
    """Two jobs on one root (a restart next to orphans): the second one's cleanup deleted
    the first one's staging directory mid-save, and the first crashed. Now the second is
    refused with the holder's pid while the first completes its save."""
    root, gate = tmp_path / "ckpt", tmp_path / "gate"
    gate.mkdir()
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(_run_first_job, str(root), str(gate))
        try:
            second = launch(_second_job, 2, str(root), str(gate), timeout=WAIT,
                            join_timeout=2 * WAIT)
        finally:
            (gate / "second_tried").touch()  # whatever happened, the first job goes on
            saved = first.result(timeout=3 * WAIT)  # the first job's own error comes first
    holder = saved[0]["pid"]
    for rank, result in enumerate(second):  # every rank of the second job got the typed error
        assert result["refused"] is not None, f"rank {rank} of the second job saved"
        assert (result["pid"], result["root"]) == (holder, str(root)), result
        assert f"held by process {holder}" in result["refused"]
    assert saved[0]["directory"] == str(root / "step_000002")
    assert read_manifest(saved[0]["directory"]).step == 2
    assert (root / LATEST).read_text().strip() == "step_000002"
    assert not [name for name in os.listdir(root) if ".partial-" in name or ".tmp-" in name]
    # the first job's processes have ended: the kernel released the root
    assert launch(_third_job, 2, str(root), timeout=WAIT, join_timeout=2 * WAIT)[0] == str(
        root / "step_000001")
    assert (root / LATEST).read_text().strip() == "step_000001"
