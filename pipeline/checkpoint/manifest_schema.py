"""The manifest's fields (`Manifest`, `FileEntry`, `SavedSplit`) and the JSON it is written as."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from pipeline.checkpoint.atomic_files import sha256_bytes
from pipeline.checkpoint.signing import sign, signing_key

__all__ = ["FORMAT", "LATEST", "MANIFEST", "ROLES", "VERSION", "FileEntry", "Manifest",
           "SavedSplit", "dump_manifest", "step_name"]

FORMAT = "pipesched-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
ROLES = ("layer", "optimizer", "rng", "client")


def step_name(step: int) -> str:
    """The directory name of the checkpoint taken after `step` optimizer steps."""
    return f"step_{step:06d}"


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint and how to check it."""

    path: str
    """Name inside the step directory (no directories: a manifest cannot point elsewhere)."""
    sha256: str
    size: int
    role: str
    """'layer', 'optimizer', 'rng' or 'client' (the DeepSpeed layer's client state)."""
    rank: int
    """Global rank that wrote it."""
    layers: tuple[int, ...]
    """Global layer indices whose weights (or optimizer state) it holds."""


@dataclass(frozen=True)
class SavedSplit:
    """How the saving job cut one parameter over its tensor- or expert-parallel ranks: rank
    i of `size` along `axis` held its part of each of `blocks` along `dim`
    (`pipeline.parallel.tensor.shard_layout.ShardLayout`; experts: dim 0, one block of E)."""

    layer: int
    name: str
    """The parameter's name inside its layer."""
    axis: str
    """'tp' (the slice file of tp rank i) or 'ep' (the expert file of ep rank i)."""
    dim: int
    blocks: tuple[int, ...]
    size: int


@dataclass(frozen=True)
class Manifest:
    """Everything a loader needs to know before opening a checkpoint file."""

    step: int
    world_size: int
    topology: tuple[int, int, int]
    """(pp, dp, tp) of the job that saved it."""
    num_layers: int
    boundaries: tuple[int, ...]
    """Stage cut of the saving job (informative: any cut loads)."""
    schedule: str
    num_microbatches: int
    optimizer: str
    """'none', 'torch' (per-parameter state) or 'zero' (ZeRO-1 shards with offsets)."""
    optimizer_class: str
    loss_scaler: dict[str, float] | None
    files: tuple[FileEntry, ...]
    run_id: str = ""
    """The run that saved it (16 hex digits, kept across a job's saves and resumes into one
    root; "" in checkpoints from before run ids): signed with the rest, and checked against
    the signed `latest` (`pipeline.checkpoint.pointer`)."""
    ep: int = 1
    """Expert parallelism of the saving job (1 in checkpoints from before it was recorded)."""
    cp: int = 1
    """Context parallelism of the saving job (1 in checkpoints from before it was recorded):
    its cp ranks hold the same weights, so cp rank 0 writes them; world_size is pp·dp·cp·tp."""
    splits: tuple[SavedSplit, ...] = ()
    """Every parameter saved as tp or ep slices, and how it was cut (`pipeline.checkpoint.
    reshard` merges them under another tp or ep)."""


def dump_manifest(manifest: Manifest) -> bytes:
    """The manifest as JSON bytes, with a sha256 over its own canonical form."""
    body = {"format": FORMAT, "version": VERSION, **asdict(manifest)}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    body["checksum"] = sha256_bytes(text.encode())
    key = signing_key()
    if key is not None:  # the manifest holds every file's sha256: this signs them all
        body["signature"] = sign(text.encode(), key)
    return json.dumps(body, sort_keys=True, indent=1).encode()
