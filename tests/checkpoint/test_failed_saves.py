"""Saves that fail with an error (a full disk) and loads of a well-formed file of the wrong
layout: nothing is left half-done, and the message says what is on disk."""

from __future__ import annotations

import errno
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from pipeline import PipelineEngine, PipelineModule, launch
from pipeline.checkpoint import atomic_files
from pipeline.checkpoint import save as save_module
from pipeline.checkpoint.load import load_checkpoint
from pipeline.checkpoint.manifest import LATEST, read_manifest
from pipeline.checkpoint.rng_state import capture_rng
from pipeline.checkpoint.save import CheckpointParts, save_checkpoint
from pipeline.errors import CheckpointError
from pipeline.parallel.precision import DynamicLossScaler
from tests.support.checkpoint_cases import Job
from tests.support.pipeline_models import MODELS


def _fill_disk_at(monkeypatch: pytest.MonkeyPatch, prefix: str) -> list[str]:
    """Make every write of a temporary file whose name starts with `prefix` stop half-way
    with ENOSPC, as a full disk does; returns the paths it failed."""
    real = atomic_files._write_durably
    failed: list[str] = []

    def write(path: str, data: bytes, dir_fd: int | None = None) -> None:
        if not os.path.basename(path).startswith(prefix):
            real(path, data, dir_fd)
            return
        with os.fdopen(os.open(path, atomic_files.CREATE_FLAGS, 0o644, dir_fd=dir_fd),
                       "wb") as handle:  # what fitted before the disk was full
            handle.write(data[:len(data) // 2])
        failed.append(path)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(atomic_files, "_write_durably", write)
    return failed


def _debris(root: Path) -> list[str]:
    """Everything a failed save may leave: staging directories, temporary files."""
    return sorted(str(path.relative_to(root)) for path in root.rglob("*")
                  if ".partial-" in path.name or ".tmp-" in path.name)


def _saved_twice(tmp_path: Path) -> tuple[Job, dict[tuple[int, str], torch.Tensor]]:
    """A job with step 1 saved and one more step trained (its weights returned)."""
    job = Job()
    job.train(1)
    save_checkpoint(str(tmp_path), job.parts())
    job.train(1)
    return job, job.weights()


# where the disk fills -> what the error must say ({root} is the checkpoint root)
FULL_DISK = {
    ".layer_": r"writing the checkpoint files failed on rank 0: cannot write into .*step_000002"
               r"\.partial-.*No space left on device.*nothing was committed, the staging "
               r"directory is removed and 'latest' still names step_000001",
    ".optim_": r"No space left on device.*nothing was committed.*'latest' still names "
               r"step_000001",
    ".manifest.json": r"cannot commit .*step_000002\.partial-.*No space left on device.*nothing "
                      r"was committed, the staging directory is removed and 'latest' still "
                      r"names step_000001",
    ".latest": r"step_000002 is complete on disk .* but pointing 'latest' at it failed .*No "
               r"space left on device.*'latest' still names step_000001: load .*step_000002 "
               r"directly",
}


@pytest.mark.parametrize("prefix", sorted(FULL_DISK))
def test_a_save_failing_on_a_full_disk_leaves_no_partial_directory_or_latest_tmp(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefix: str) -> None:
    job, _ = _saved_twice(tmp_path)
    failed = _fill_disk_at(monkeypatch, prefix)
    with pytest.raises(CheckpointError, match=FULL_DISK[prefix]):
        save_checkpoint(str(tmp_path), job.parts())
    assert failed, "the disk never filled: the test's write seam was bypassed"
    assert _debris(tmp_path) == []  # swept at the failure, not at a later success
    assert (tmp_path / LATEST).read_text().strip() == "step_000001"
    committed = (tmp_path / "step_000002").exists()
    assert committed == (prefix == ".latest")
    monkeypatch.undo()
    assert load_checkpoint(str(tmp_path), Job(base_seed=3).parts()).step == 1
    job.train(1)
    save_checkpoint(str(tmp_path), job.parts())  # the disk has room again: a normal save
    assert (tmp_path / LATEST).read_text().strip() == "step_000003" and _debris(tmp_path) == []


def test_a_full_disk_at_latest_says_the_step_directory_is_complete(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC while writing `latest` once said "cannot commit <staging>" although the step
    directory was complete and committed; the message now says so and the copy loads."""
    job, weights = _saved_twice(tmp_path)
    _fill_disk_at(monkeypatch, ".latest")
    with pytest.raises(CheckpointError) as caught:
        save_checkpoint(str(tmp_path), job.parts())
    message = str(caught.value)
    assert "cannot commit" not in message and ".partial-" not in message, message
    assert caught.value.path == str(tmp_path / LATEST)
    step_dir = tmp_path / "step_000002"
    assert read_manifest(str(step_dir)).step == 2
    fresh = Job(base_seed=9)
    assert load_checkpoint(str(step_dir), fresh.parts()).step == 2
    assert all(torch.equal(fresh.weights()[key], value) for key, value in weights.items())


def test_a_full_disk_while_re_saving_a_step_keeps_the_old_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = Job()
    job.train(1)
    save_checkpoint(str(tmp_path), job.parts())
    before = job.weights()
    job.train(1)
    job.step = 1  # rolled back: the same step directory is saved again
    _fill_disk_at(monkeypatch, ".manifest.json")
    with pytest.raises(CheckpointError, match="nothing was committed"):
        save_checkpoint(str(tmp_path), job.parts())
    assert _debris(tmp_path) == [] and not list(tmp_path.glob("*.old-*"))
    fresh = Job(base_seed=3)
    assert load_checkpoint(str(tmp_path), fresh.parts()).step == 1
    assert all(torch.equal(fresh.weights()[key], value) for key, value in before.items())


def _numpy_part() -> dict[str, Any]:
    return dict(capture_rng()["numpy"])


# well-formed files (torch.load reads them, the manifest's sha256 matches) of another layout
WRONG_LAYOUTS: dict[str, Callable[[], Any]] = {
    "numpy missing": lambda: {k: v for k, v in capture_rng().items() if k != "numpy"},
    "a list": lambda: [torch.get_rng_state()],
    "torch state truncated": lambda: {**capture_rng(), "torch": torch.get_rng_state()[:100]},
    "python state short": lambda: {**capture_rng(), "python": (3, tuple(range(10)), None)},
    "numpy keys short": lambda: {**capture_rng(), "numpy": {
        **_numpy_part(), "keys": torch.zeros(5, dtype=torch.int64)}},
    "accelerator not a list": lambda: {**capture_rng(), "accelerator": torch.zeros(3)},
}


@pytest.mark.parametrize("layout", sorted(WRONG_LAYOUTS))
def test_a_wrong_layout_rng_file_is_refused_before_anything_is_replaced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    """A well-formed rng file of the wrong layout was refused only after the weights and the
    optimizer state were replaced ("partly loaded")."""
    job = Job()
    job.train(2)
    monkeypatch.setattr(save_module, "capture_rng", WRONG_LAYOUTS[layout])
    save_checkpoint(str(tmp_path), job.parts())
    monkeypatch.undo()
    fresh = Job(base_seed=5)
    fresh.train(1)  # some optimizer state to keep
    weights = fresh.weights()
    moments = {key: {name: value.clone() for name, value in state.items()}
               for key, state in enumerate(fresh.optimizer.state.values())}
    generators = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    with pytest.raises(CheckpointError, match=r"rng_rank_0000\.pt") as caught:
        load_checkpoint(str(tmp_path), fresh.parts())
    assert "partly loaded" not in str(caught.value)
    assert caught.value.path.endswith("rng_rank_0000.pt")
    assert all(torch.equal(fresh.weights()[key], value) for key, value in weights.items())
    for key, state in enumerate(fresh.optimizer.state.values()):
        assert all(torch.equal(state[name], value) for name, value in moments[key].items())
    assert torch.equal(torch.get_rng_state(), generators[0])
    assert random.getstate() == generators[1]
    assert np.array_equal(np.random.get_state()[1], generators[2])


def _full_disk_on_rank_1(root: str) -> str:
    """Saves step 1, then step 2 with rank 1's first file write failing with ENOSPC."""
    module = PipelineModule(MODELS["mlp"].layers(), num_stages=2, loss_fn=MODELS["mlp"].loss)
    engine = PipelineEngine(module, schedule="1f1b", num_microbatches=2, timeout=120,
                            optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    engine.train_batch(*MODELS["mlp"].batch(seed=0, batch=8))
    engine.save_checkpoint(root)
    engine.train_batch(*MODELS["mlp"].batch(seed=1, batch=8))
    if dist.get_rank() == 1:
        def full(path: str, data: bytes, dir_fd: int | None = None) -> None:
            with os.fdopen(os.open(path, atomic_files.CREATE_FLAGS, 0o644, dir_fd=dir_fd),
                           "wb") as handle:
                handle.write(data[:len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        atomic_files._write_durably = full  # this rank's process only
    try:
        engine.save_checkpoint(root)
    except CheckpointError as error:
        return str(error)
    return "saved"


@pytest.mark.multiprocess
def test_a_full_disk_on_another_rank_leaves_no_partial_directory(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    messages = launch(_full_disk_on_rank_1, 2, str(root), timeout=120, join_timeout=600)
    for message in messages:  # every rank refuses, naming the rank that failed
        assert message.startswith("writing the checkpoint files failed on rank 1"), message
        assert "'latest' still names step_000001" in message, message
    assert _debris(root) == [] and (root / LATEST).read_text().strip() == "step_000001"
    assert not (root / "step_000002").exists()


class _OtherScaler:
    """A loss scaler with other fields than `DynamicLossScaler`'s."""

    def state_dict(self) -> dict[str, float]:
        return {"scale": 1.0}

    def load_state_dict(self, state: dict[str, float]) -> None:
        raise AssertionError("a load must not reach a scaler whose fields do not fit")


def _foreign_parameter(job: Job, parts: CheckpointParts) -> None:
    job.optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})


def _other_scaler_fields(job: Job, parts: CheckpointParts) -> None:
    parts.loss_scaler = _OtherScaler()


@pytest.mark.parametrize("mismatch", [_foreign_parameter, _other_scaler_fields],
                         ids=["optimizer holds a foreign parameter", "scaler has other fields"])
def test_a_job_that_does_not_fit_the_checkpoint_is_refused_before_anything_is_replaced(
        tmp_path: Path, mismatch: Callable[[Job, CheckpointParts], None]) -> None:
    """These mismatches were found only while applying, after the weights were replaced."""
    job = Job()
    job.train(1)
    parts = job.parts()
    parts.loss_scaler = DynamicLossScaler(None, init_scale=8.0)
    save_checkpoint(str(tmp_path), parts)
    fresh = Job(base_seed=5)
    parts = fresh.parts()
    parts.loss_scaler = DynamicLossScaler(None)
    mismatch(fresh, parts)
    weights = fresh.weights()
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(str(tmp_path), parts)
    assert "partly loaded" not in str(caught.value)
    assert all(torch.equal(fresh.weights()[key], value) for key, value in weights.items())
