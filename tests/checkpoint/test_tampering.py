"""Signatures cover everything a resume reads: with PIPESCHED_CHECKPOINT_KEY set, a missing
client state, a step directory from another run, a rollback of `latest` by hand and a
manifest giving "step" twice are refused; crafted layer files that are a FIFO or /dev/zero
are refused without blocking or reading without bound (with or without a key)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.checkpoint.atomic_files import sha256_bytes
from pipeline.checkpoint.load import load_checkpoint
from pipeline.checkpoint.manifest import LATEST, MANIFEST, read_manifest
from pipeline.checkpoint.root_lock import release_root
from pipeline.checkpoint.save import save_checkpoint
from pipeline.checkpoint.signing import KEY_ENV
from pipeline.errors import CheckpointError
from pipeline.interop.ds_client_state import CLIENT_STATE, client_state_bytes, read_client_state
from tests.support.checkpoint_cases import Job

_REPO = str(Path(__file__).resolve().parents[2])


@pytest.fixture
def key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "secret-one")


def _run(root: Path, steps: int, *, client: bool = False) -> list[Path]:
    """A job saving after each of `steps` steps into `root`; the step directories."""
    job, saved = Job(), []
    try:
        for _ in range(steps):
            job.train(1)
            parts = job.parts()
            if client:
                parts.extra_files = {CLIENT_STATE: client_state_bytes(
                    {"client_state": {"epoch": job.step}, "global_samples": 8 * job.step})}
            saved.append(Path(save_checkpoint(str(root), parts).directory))
    finally:
        release_root(str(root))
    return saved


def _load(path: Path) -> int:
    return load_checkpoint(str(path), Job(base_seed=3).parts()).step


def test_a_deleted_client_state_is_refused_not_loaded_as_empty(tmp_path: Path,
                                                               key: None) -> None:
    # regression: client_state.pt lay outside the signature, written after the commit;
    # deleting it loaded with client_state={} (scheduler back to step 0, global_samples=0)
    (step_dir,) = _run(tmp_path, 1, client=True)
    entries = {entry.path: entry.role for entry in read_manifest(str(step_dir)).files}
    assert entries[CLIENT_STATE] == "client"  # listed, so signed with the manifest
    assert read_client_state(step_dir)["global_samples"] == 8
    (step_dir / CLIENT_STATE).unlink()
    with pytest.raises(CheckpointError, match=r"client_state\.pt is missing"):
        _load(tmp_path)
    with pytest.raises(CheckpointError, match=r"client_state\.pt"):
        read_client_state(step_dir)


def test_a_step_directory_from_another_run_is_refused(tmp_path: Path, key: None) -> None:
    # regression: with the same key, `cp -r other/ckpt/step_N ckpt/` loaded silently
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    _run(ours, 2)
    foreign = _run(theirs, 3)
    shutil.rmtree(ours / "step_000002")
    shutil.copytree(foreign[1], ours / "step_000002")  # replaces the step `latest` names
    with pytest.raises(CheckpointError, match="copied from another run"):
        _load(ours)
    shutil.copytree(foreign[2], ours / "step_000003")  # and made `latest` by hand
    (ours / LATEST).write_text("step_000003\n")
    with pytest.raises(CheckpointError, match="not signed"):
        _load(ours)


def test_a_rollback_by_editing_latest_is_refused_with_a_key(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            key: None) -> None:
    # regression: `echo step_000001 > ckpt/latest` loaded the older step silently
    _run(tmp_path, 2)
    assert _load(tmp_path) == 2
    (tmp_path / LATEST).write_text("step_000001\n")
    with pytest.raises(CheckpointError, match="not signed"):
        _load(tmp_path)
    assert _load(tmp_path / "step_000001") == 1  # the documented way: name the directory
    monkeypatch.delenv(KEY_ENV)  # without a key, `latest` is a plain name (docs)
    assert _load(tmp_path) == 1


def test_a_manifest_giving_step_twice_is_refused(tmp_path: Path) -> None:
    # regression: json kept the last of two "step" keys, though the docs say duplicates
    # are refused
    (step_dir,) = _run(tmp_path, 1)
    path = step_dir / MANIFEST
    text = path.read_text()
    assert text.count('"step": 1') == 1
    path.write_text(text.replace('"step": 1', '"step": 1,\n "step": 1', 1))
    with pytest.raises(CheckpointError, match="'step' twice"):
        _load(tmp_path)


def _replace_layer(step_dir: Path, make: str) -> Path:
    """Swap a layer file for a FIFO or a link to /dev/zero and re-hash the manifest (size 0,
    the empty sha256) as an attacker without a key can."""
    doc = json.loads((step_dir / MANIFEST).read_text())
    entry = next(item for item in doc["files"] if item["role"] == "layer")
    target = step_dir / entry["path"]
    target.unlink()
    if make == "fifo":
        os.mkfifo(target)
    else:
        target.symlink_to("/dev/zero")
    entry["size"], entry["sha256"] = 0, sha256_bytes(b"")
    doc.pop("checksum")
    doc["checksum"] = sha256_bytes(json.dumps(doc, sort_keys=True,
                                              separators=(",", ":")).encode())
    (step_dir / MANIFEST).write_text(json.dumps(doc, sort_keys=True, indent=1))
    return target


@pytest.mark.parametrize("make", ["fifo", "dev-zero"])
def test_a_layer_file_that_is_a_fifo_or_dev_zero_is_refused_without_blocking(
        tmp_path: Path, make: str) -> None:
    # regression: verify-checkpoint hung on a FIFO; a load read /dev/zero without bound
    (step_dir,) = _run(tmp_path, 1)
    target = _replace_layer(step_dir, make)
    with pytest.raises(CheckpointError, match="not a regular file"):
        _load(tmp_path)
    verify = subprocess.run([sys.executable, "-m", "pipeline.cli", "verify-checkpoint",
                             str(tmp_path)], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": _REPO})
    assert verify.returncode == 2, verify.stderr
    assert str(target) in verify.stderr and "Traceback" not in verify.stderr
