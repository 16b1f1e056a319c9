"""Checkpoint files in one process: exact round trip, a crash at every moment of a save leaves
a loadable checkpoint, and every corruption is refused naming the file."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.checkpoint.load import load_checkpoint
from pipeline.checkpoint.manifest import LATEST, read_manifest, resolve_checkpoint, verify_files
from pipeline.checkpoint.save import save_checkpoint
from pipeline.errors import CheckpointError
from pipeline.parallel.precision import DynamicLossScaler
from pipeline.supervision import faults
from tests.support.checkpoint_cases import Job, corruption_cases


class _Crash(Exception):
    """Stands for the process dying at a fault point (what is on disk is the same)."""


def _crash() -> None:
    raise _Crash


def _optimizer_state(job: Job) -> list[dict[str, torch.Tensor]]:
    return [dict(job.optimizer.state[p]) for p in job.module.parameters()]


def test_round_trip_restores_weights_optimizer_step_and_generators(tmp_path: Path) -> None:
    job = Job()
    job.train(3)
    info = save_checkpoint(str(tmp_path), job.parts())
    assert info.directory == str(tmp_path / "step_000003")
    assert (tmp_path / LATEST).read_text().strip() == "step_000003"
    expected_draw = torch.rand(3)
    uninterrupted = job.train(2)
    fresh = Job(base_seed=99)  # other initial weights: the load must replace all of them
    loaded = load_checkpoint(str(tmp_path), fresh.parts())
    fresh.step = loaded.step
    assert loaded.step == 3 and loaded.rng_restored
    assert torch.equal(torch.rand(3), expected_draw)  # the generator continues where it was
    assert fresh.train(2) == uninterrupted  # exactly: same weights, Adam moments and step
    for key, value in job.weights().items():
        assert torch.equal(fresh.weights()[key], value), key
    names = sorted(os.listdir(info.directory))
    assert names[-1] == "rng_rank_0000.pt" and "optim_rank_0000.pt" in names
    assert sum(name.startswith("layer_") for name in names) == 8  # tanh layers hold nothing
    assert read_manifest(info.directory).topology == (1, 1, 1)


@pytest.mark.parametrize("point", faults.FAULT_POINTS)
@pytest.mark.parametrize("replace", [False, True], ids=["new step", "same step again"])
def test_a_crash_at_any_moment_of_a_save_leaves_a_complete_checkpoint(
        tmp_path: Path, point: str, replace: bool) -> None:
    job = Job()
    job.train(1)
    save_checkpoint(str(tmp_path), job.parts())
    before = job.weights()
    if not replace:
        job.train(1)
    after = job.weights()
    if point == "checkpoint.swap" and not replace:
        return  # only a save over an existing step directory swaps
    points = faults.FaultPoints()
    points.arm(point, _crash, skip=1 if point == "checkpoint.file" else 0)  # mid-way
    with pytest.raises(_Crash):
        save_checkpoint(str(tmp_path), dataclasses.replace(job.parts(), faults=points))
    # `latest` names the previous checkpoint until the very last rename
    fresh = Job(base_seed=7)
    assert load_checkpoint(str(tmp_path), fresh.parts()).step == 1
    assert all(torch.equal(fresh.weights()[k], v) for k, v in before.items())
    if not replace:
        new = [d for d in os.listdir(tmp_path) if d.startswith("step_000002")]
        assert len(new) == 1
        if point in ("checkpoint.commit", "checkpoint.latest"):  # complete: loads when named
            assert load_checkpoint(str(tmp_path / new[0]), fresh.parts()).step == 2
            assert all(torch.equal(fresh.weights()[k], v) for k, v in after.items())
        else:  # no manifest: refused when named
            with pytest.raises(CheckpointError, match=r"has no manifest\.json"):
                load_checkpoint(str(tmp_path / new[0]), fresh.parts())
    # the next save sweeps up what the crash left and commits normally
    job.train(1)
    save_checkpoint(str(tmp_path), job.parts())
    left = [d for d in os.listdir(tmp_path) if ".partial-" in d or ".old-" in d]
    assert left == [] and load_checkpoint(str(tmp_path), fresh.parts()).step == job.step


def test_every_corruption_is_refused_naming_the_file(tmp_path: Path) -> None:
    job = Job()
    job.train(2)
    pristine = Path(save_checkpoint(str(tmp_path / "pristine"), job.parts()).directory)
    cases = corruption_cases(str(pristine))
    assert len(cases) >= 50
    for index, (case, _, corrupt) in enumerate(cases):
        root = tmp_path / f"case{index}"
        shutil.copytree(pristine.parent, root)
        named = corrupt(str(root / pristine.name))
        fresh = Job(base_seed=5)
        untouched = fresh.weights()
        with pytest.raises(CheckpointError) as caught:
            load_checkpoint(str(root), fresh.parts())
        assert os.path.basename(named) in str(caught.value), (case, str(caught.value))
        assert caught.value.path.endswith(os.path.basename(named)), case
        # refused before anything changed
        assert all(torch.equal(fresh.weights()[k], v) for k, v in untouched.items()), case
        shutil.rmtree(root)


def test_the_loss_scaler_state_round_trips(tmp_path: Path) -> None:
    job = Job()
    parts = job.parts()
    scaler = parts.loss_scaler = DynamicLossScaler(None, init_scale=1024.0, growth_interval=2)
    for overflow in (False, True, False):
        scaler.update(overflow)
    save_checkpoint(str(tmp_path), parts)
    fresh = Job().parts()
    restored = fresh.loss_scaler = DynamicLossScaler(None)
    load_checkpoint(str(tmp_path), fresh)
    assert restored.state_dict() == scaler.state_dict() == {
        "scale": 512.0, "clean_steps": 1.0, "skipped_steps": 1.0}


def test_verify_and_resolve_refuse_what_is_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        resolve_checkpoint(str(tmp_path))
    job = Job()
    step_dir = save_checkpoint(str(tmp_path), job.parts()).directory
    (tmp_path / LATEST).unlink()
    with pytest.raises(CheckpointError, match=r"has no 'latest' pointer; pass a step directory "
                                              r"such as .*step_000000"):
        resolve_checkpoint(str(tmp_path))
    assert resolve_checkpoint(step_dir) == step_dir
    verify_files(step_dir, read_manifest(step_dir).files)


def test_a_checkpoint_refuses_another_model_or_optimizer(tmp_path: Path) -> None:
    job = Job()
    job.train(1)
    save_checkpoint(str(tmp_path), job.parts())
    other = Job()
    other.optimizer = torch.optim.SGD(other.module.parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match="its optimizer is Adam, this job's SGD"):
        load_checkpoint(str(tmp_path), other.parts())
    assert load_checkpoint(str(tmp_path), other.parts(), load_optimizer=False).step == 1
    from pipeline import PipelineModule
    from tests.support.pipeline_models import mlp_layers

    shorter = Job()
    shorter.module = PipelineModule(mlp_layers()[:-2], num_stages=1)
    shorter.module.materialize([0])
    shorter.optimizer = torch.optim.Adam(shorter.module.parameters())
    with pytest.raises(CheckpointError, match="holds 16 layers, the module has 14"):
        load_checkpoint(str(tmp_path), shorter.parts())


def test_swapped_step_directories_are_refused(tmp_path: Path) -> None:
    # regression: after swapping step_000004 and step_000006, verify printed "step_000006:
    # complete — step 4" and a load resumed at step 4
    job = Job()
    job.train(1)
    first = save_checkpoint(str(tmp_path), job.parts()).directory
    job.train(1)
    second = save_checkpoint(str(tmp_path), job.parts()).directory
    os.rename(first, str(tmp_path / "swap"))
    os.rename(second, first)
    os.rename(str(tmp_path / "swap"), second)
    fresh = Job(base_seed=5)
    untouched = fresh.weights()
    with pytest.raises(CheckpointError, match=r"named for step 2 but its manifest\.json records "
                                              r"step 1: the directories were renamed"):
        load_checkpoint(str(tmp_path), fresh.parts())  # `latest` names step_000002
    with pytest.raises(CheckpointError, match="named for step 1 but"):
        load_checkpoint(first, fresh.parts())
    assert all(torch.equal(fresh.weights()[key], value) for key, value in untouched.items())
    renamed = tmp_path / "best"  # a directory renamed to something else is the user's choice
    os.rename(second, renamed)
    assert load_checkpoint(str(renamed), fresh.parts()).step == 1
