"""Trust: with PIPESCHED_CHECKPOINT_KEY set, saves are signed and loads refuse anything
unsigned or altered (a crafted edit with recomputed checksums included); the DeepSpeed
layer's client_state.pt is read without running code. The tamperings a key must catch beyond
an edit are in test_tampering.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from pipeline.checkpoint.atomic_files import sha256_bytes
from pipeline.checkpoint.load import load_checkpoint
from pipeline.checkpoint.manifest import MANIFEST
from pipeline.checkpoint.save import save_checkpoint
from pipeline.checkpoint.signing import KEY_ENV
from pipeline.errors import CheckpointError
from pipeline.interop.ds_client_state import CLIENT_STATE, client_state_bytes, read_client_state
from tests.support.checkpoint_cases import Job


def _saved(tmp_path: Path) -> Path:
    job = Job()
    job.train(1)
    return Path(save_checkpoint(str(tmp_path), job.parts()).directory)


def _craft(step_dir: Path, change: str) -> None:
    """Edit the manifest as an attacker would: change a field, recompute its checksum."""
    path = step_dir / MANIFEST
    doc = json.loads(path.read_text())
    doc.pop("checksum")
    signature = doc.pop("signature", None)
    if change == "strip":
        signature = None
    else:
        doc["step"] = 999
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    doc["checksum"] = sha256_bytes(canonical.encode())
    if signature is not None:
        doc["signature"] = signature  # kept, now over other contents
    path.write_text(json.dumps(doc, sort_keys=True, indent=1))


def test_a_signed_checkpoint_loads_with_its_key(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "secret-one")
    step_dir = _saved(tmp_path)
    assert "signature" in json.loads((step_dir / MANIFEST).read_text())
    assert load_checkpoint(str(tmp_path), Job(base_seed=3).parts()).step == 1


@pytest.mark.parametrize(("case", "message"), [
    ("edited", "its signature does not match"),
    ("strip", "it is not signed"),
    ("other key", "its signature does not match"),
    ("unsigned", "it is not signed"),
])
def test_with_a_key_unsigned_or_altered_checkpoints_are_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str, message: str) -> None:
    # regression: a crafted edit with recomputed sha256 (step 999) loaded
    if case != "unsigned":
        monkeypatch.setenv(KEY_ENV, "secret-one")
    step_dir = _saved(tmp_path)
    if case in ("edited", "strip"):
        _craft(step_dir, case)
    monkeypatch.setenv(KEY_ENV, "secret-two" if case == "other key" else "secret-one")
    fresh = Job(base_seed=3)
    before = fresh.weights()
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(str(tmp_path), fresh.parts())
    assert all(torch.equal(fresh.weights()[k], v) for k, v in before.items())
    monkeypatch.delenv(KEY_ENV)
    if case in ("other key", "unsigned"):  # intact: without a key, checksums suffice
        assert load_checkpoint(str(tmp_path), fresh.parts()).step == 1


class _RunsCode:
    """Unpickling this would call os.mkdir(marker)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (os.mkdir, (self.marker,))


def _with_client_state(tmp_path: Path, extra: object) -> Path:
    job = Job()
    job.train(1)
    parts = job.parts()
    parts.extra_files = {CLIENT_STATE: client_state_bytes(extra)}  # type: ignore[arg-type]
    return Path(save_checkpoint(str(tmp_path), parts).directory)


def test_client_state_is_loaded_without_running_code(tmp_path: Path) -> None:
    # regression: torch.load(weights_only=False) let a checkpoint folder run code
    marker = tmp_path / "ran"
    step_dir = _with_client_state(tmp_path / "evil", {"client_state": _RunsCode(str(marker))})
    with pytest.raises(CheckpointError, match="cannot be read safely"):
        read_client_state(step_dir)
    assert not marker.exists()
    scheduler = torch.optim.lr_scheduler.StepLR(
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), step_size=2)
    extra = {"client_state": {"epoch": 3, "note": "x", "t": torch.ones(2)},
             "lr_scheduler": scheduler.state_dict(), "global_samples": 64}
    loaded = read_client_state(_with_client_state(tmp_path / "good", extra))
    assert loaded["client_state"]["epoch"] == 3 and loaded["global_samples"] == 64
    assert torch.equal(loaded["client_state"]["t"], torch.ones(2))
    assert loaded["lr_scheduler"] == scheduler.state_dict()
