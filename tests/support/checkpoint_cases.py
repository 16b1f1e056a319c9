"""A single-process training job to checkpoint, and the corruptions a checkpoint must refuse
(shared by the tests and `benchmarks/reliability_report.py`)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from pipeline import PipelineModule, Topology
from pipeline.checkpoint.manifest import LATEST, MANIFEST
from pipeline.checkpoint.save import CheckpointParts
from tests.support.pipeline_models import mlp_batch, mlp_layers

__all__ = ["CORRUPTIONS", "Job", "corruption_cases"]


class Job:
    """One process holding the whole 16-layer MLP (p = 1) with Adam: enough to exercise
    every file kind of a checkpoint without starting ranks."""

    def __init__(self, base_seed: int = 1234) -> None:
        self.module = PipelineModule(mlp_layers(), num_stages=1, loss_fn=F.mse_loss,
                                     base_seed=base_seed)
        self.module.materialize([0])
        self.optimizer = torch.optim.Adam(self.module.parameters(), lr=0.01)
        self.step = 0

    def train(self, steps: int) -> list[float]:
        losses = []
        for _ in range(steps):
            inputs, targets = mlp_batch(seed=self.step)
            self.optimizer.zero_grad()
            loss = F.mse_loss(self.module(inputs), targets)
            loss.backward()
            self.optimizer.step()
            self.step += 1
            losses.append(loss.item())
        return losses

    def parts(self) -> CheckpointParts:
        return CheckpointParts(module=self.module, topology=Topology(1), rank=0, step=self.step,
                               optimizer=self.optimizer, schedule="1f1b")

    def weights(self) -> dict[tuple[int, str], torch.Tensor]:
        return {key: p.detach().clone() for key, p in self.module.named_layer_parameters()}


Corruption = Callable[[str, str], str]
"""(step directory, file name) -> the path the refusal must name."""


def _truncate(step_dir: str, name: str) -> str:
    path = os.path.join(step_dir, name)
    with open(path, "r+b") as handle:
        handle.truncate(max(0, os.path.getsize(path) // 2))
    return path


def _flip_byte(step_dir: str, name: str) -> str:
    path = os.path.join(step_dir, name)
    with open(path, "r+b") as handle:
        handle.seek(os.path.getsize(path) // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0x40]))
    return path


def _delete(step_dir: str, name: str) -> str:
    path = os.path.join(step_dir, name)
    os.remove(path)
    return path


def _replace_with_other(step_dir: str, name: str) -> str:
    """Same size, other contents: another file of the checkpoint, cut or padded to size."""
    path = os.path.join(step_dir, name)
    others = sorted(n for n in os.listdir(step_dir) if n not in (name, MANIFEST))
    with open(os.path.join(step_dir, others[0]), "rb") as handle:
        data = handle.read()
    size = os.path.getsize(path)
    with open(path, "wb") as handle:
        handle.write((data * (size // max(1, len(data)) + 1))[:size])
    return path


CORRUPTIONS: dict[str, Corruption] = {
    "truncated": _truncate, "flipped byte": _flip_byte, "deleted": _delete,
    "swapped contents": _replace_with_other,
}
"""Applied to every file of a checkpoint (the manifest included)."""


def _edit_manifest(change: Callable[[dict[str, Any]], None]) -> Callable[[str], str]:
    def corrupt(step_dir: str) -> str:
        path = os.path.join(step_dir, MANIFEST)
        with open(path) as handle:
            document = json.load(handle)
        change(document)
        with open(path, "w") as handle:
            json.dump(document, handle)
        return path
    return corrupt


def _write(relative: str, data: bytes) -> Callable[[str], str]:
    def corrupt(step_dir: str) -> str:
        path = os.path.join(step_dir, relative)
        with open(path, "wb") as handle:
            handle.write(data)
        return path
    return corrupt


def _root_pointer(data: bytes) -> Callable[[str], str]:
    def corrupt(step_dir: str) -> str:
        path = os.path.join(os.path.dirname(step_dir), LATEST)
        with open(path, "wb") as handle:
            handle.write(data)
        return path
    return corrupt


def _remove_directory(step_dir: str) -> str:
    shutil.rmtree(step_dir)
    return os.path.join(os.path.dirname(step_dir), LATEST)


WHOLE_CHECKPOINT: dict[str, Callable[[str], str]] = {
    "manifest edited (step changed)": _edit_manifest(lambda d: d.update(step=d["step"] + 1)),
    "manifest lists a file twice": _edit_manifest(lambda d: d["files"].append(d["files"][0])),
    "manifest from a future version": _edit_manifest(lambda d: d.update(version=99)),
    "manifest is not JSON": _write(MANIFEST, b"{\"format\": \"pipesched-checkpoint\", "),
    "manifest is binary": _write(MANIFEST, bytes(range(256))),
    "manifest is a list": _write(MANIFEST, b"[1, 2, 3]"),
    "manifest is empty": _write(MANIFEST, b""),
    "latest names a missing step": _root_pointer(b"step_999999\n"),
    "latest holds a path": _root_pointer(b"../../etc\n"),
    "latest is binary": _root_pointer(b"\xff\xfe"),
    "step directory deleted": _remove_directory,
}
"""Applied once per checkpoint; the root is loaded (following `latest`)."""


def corruption_cases(step_dir: str) -> list[tuple[str, str, Callable[[str], str]]]:
    """(case name, file name or '', apply(step_dir) -> path to name) for every case."""
    names = sorted(os.listdir(step_dir))
    cases: list[tuple[str, str, Callable[[str], str]]] = [
        (f"{kind}: {name}", name, _bind(corrupt, name))
        for kind, corrupt in CORRUPTIONS.items() for name in names]
    cases += [(kind, "", corrupt) for kind, corrupt in WHOLE_CHECKPOINT.items()]
    return cases


def _bind(corrupt: Corruption, name: str) -> Callable[[str], str]:
    return lambda step_dir: corrupt(step_dir, name)
