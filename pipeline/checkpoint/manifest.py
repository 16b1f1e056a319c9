"""The checkpoint manifest: what a complete checkpoint holds, read strictly, checked file by file.

Layout of a checkpoint root (see `pipeline.checkpoint.save` for how it is written)::

    root/
      latest                      one line: the name of the newest complete step directory
      step_000042/
        layer_03-model_states.pt  weights of global layer 3 (tp > 1: layer_03-tp_01-...)
        optim_rank_0001.pt        rank 1's optimizer state, per (layer, parameter) and range
        rng_rank_0001.pt          rank 1's random generators
        manifest.json             written last: topology, schedule, step, files + sha256

Pure Python (no torch), so `pipesched verify-checkpoint` and the fuzz tests use it alone.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import stat
from dataclasses import asdict, dataclass
from typing import Any

from pipeline.checkpoint.atomic_files import read_pointer, sha256_bytes, sha256_file
from pipeline.checkpoint.manifest_bounds import bound_problems
from pipeline.checkpoint.pointer import check_pointer
from pipeline.checkpoint.signing import sign, signing_key, verify_signature
from pipeline.errors import CheckpointError
from pipeline.files import UnreadableInputError, loads_json, read_regular_file

__all__ = ["FORMAT", "LATEST", "MANIFEST", "VERSION", "FileEntry", "Manifest", "SavedSplit",
           "dump_manifest", "parse_manifest", "read_manifest", "resolve_checkpoint", "step_name",
           "verify_files"]

FORMAT = "pipesched-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
ROLES = ("layer", "optimizer", "rng", "client")
_STEP_NAME = re.compile(r"step_\d{6,}")
_STEP_PREFIX = re.compile(r"step_(\d{6,})(\.|$)")
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_RUN_ID = re.compile(r"([0-9a-f]{16})?")
_ROLE = re.compile("|".join(ROLES))
_AXIS = re.compile("tp|ep")
_MAX_MANIFEST_BYTES = 64 << 20


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


class _Reader:
    """Typed field access that collects every problem, so one error lists them all."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.problems: list[str] = []

    def integer(self, doc: dict[str, Any], key: str, minimum: int = 0) -> int:
        value = doc.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.problems.append(f"{key}={value!r} is not an int >= {minimum}")
            return minimum
        return value

    def text(self, doc: dict[str, Any], key: str, pattern: re.Pattern[str] | None = None) -> str:
        value = doc.get(key)
        if not isinstance(value, str) or (pattern is not None and not pattern.fullmatch(value)):
            shape = f" matching {pattern.pattern!r}" if pattern is not None else ""
            self.problems.append(f"{key}={_short(value)} is not a string{shape}")
            return ""
        return value

    def integers(self, doc: dict[str, Any], key: str) -> tuple[int, ...]:
        value = doc.get(key)
        if not isinstance(value, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
            self.problems.append(f"{key}={_short(value)} is not a list of ints >= 0")
            return ()
        return tuple(value)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_manifest(raw: bytes | str, *, where: str = MANIFEST) -> Manifest:
    """Read and check a manifest; `CheckpointError` naming `where` and every bad field."""
    try:  # each key once: json's default would keep the last of two "step" keys
        doc = loads_json(raw.encode() if isinstance(raw, str) else raw, where)
    except UnreadableInputError as error:
        raise CheckpointError(f"{str(error)[:240]}; the save was torn or the file was edited: "
                              "load an earlier step directory", path=where) from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{where} holds a {type(doc).__name__}, not a manifest object",
                              path=where)
    version = doc.get("version")  # `true == 1` in Python: the type too
    if doc.get("format") != FORMAT or type(version) is not int or version != VERSION:
        raise CheckpointError(f"{where} is format {_short(doc.get('format'))} version "
                              f"{_short(doc.get('version'))}; this pipesched reads {FORMAT!r} "
                              f"version {VERSION}", path=where)
    claimed = doc.pop("checksum", None)
    signature = doc.pop("signature", None)
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    if claimed != sha256_bytes(canonical.encode()):
        raise CheckpointError(f"{where}: checksum mismatch (the manifest was edited or is "
                              "corrupt); load an earlier step directory", path=where)
    key = signing_key()
    refusal = None if key is None else verify_signature(canonical.encode(), signature, key)
    if refusal is not None:
        raise CheckpointError(f"{where}: {refusal}", path=where)
    read = _Reader(where)
    topology = read.integers(doc, "topology")
    if len(topology) != 3 or 0 in topology:
        read.problems.append(f"topology={_short(doc.get('topology'))} is not [pp, dp, tp] >= 1")
        topology = (1, 1, 1)
    manifest = Manifest(
        step=read.integer(doc, "step"), world_size=read.integer(doc, "world_size", 1),
        topology=(topology[0], topology[1], topology[2]),
        num_layers=read.integer(doc, "num_layers", 1), boundaries=read.integers(doc, "boundaries"),
        schedule=read.text(doc, "schedule"),
        num_microbatches=read.integer(doc, "num_microbatches", 1),
        optimizer=read.text(doc, "optimizer", re.compile("none|torch|zero")),
        optimizer_class=read.text(doc, "optimizer_class"),
        loss_scaler=_loss_scaler(doc.get("loss_scaler"), read), files=_files(doc, read),
        run_id=read.text(doc, "run_id", _RUN_ID) if "run_id" in doc else "",
        ep=read.integer(doc, "ep", 1) if "ep" in doc else 1, splits=_splits(doc, read),
        cp=read.integer(doc, "cp", 1) if "cp" in doc else 1)
    if manifest.cp < 1 or manifest.world_size != math.prod(manifest.topology) * manifest.cp:
        read.problems.append(f"world_size={manifest.world_size} is not pp·dp·cp·tp of topology "
                             f"{list(manifest.topology)} and cp={manifest.cp}")
    if not read.problems:  # every number bounded by the files it describes
        read.problems += bound_problems(manifest)
    if read.problems:
        raise CheckpointError(f"{where} is not a valid manifest: " + "; ".join(read.problems[:8])
                              + "; it was not written by this pipesched, or was edited",
                              path=where)
    return manifest


def _loss_scaler(value: object, read: _Reader) -> dict[str, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool)
            and math.isfinite(v) for k, v in value.items()):
        read.problems.append(f"loss_scaler={_short(value)} is not null or a mapping of numbers")
        return None
    return {key: float(number) for key, number in value.items()}


def _splits(doc: dict[str, Any], read: _Reader) -> tuple[SavedSplit, ...]:
    raw = doc.get("splits", [])
    if not isinstance(raw, list):
        read.problems.append(f"splits={_short(raw)} is not a list")
        return ()
    splits = []
    for index, item in enumerate(raw):
        if not isinstance(item, dict):
            read.problems.append(f"splits[{index}]={_short(item)} is not an object")
            continue
        split = SavedSplit(layer=read.integer(item, "layer"), name=read.text(item, "name"),
                           axis=read.text(item, "axis", _AXIS), dim=read.integer(item, "dim"),
                           blocks=read.integers(item, "blocks"),
                           size=read.integer(item, "size", 1))
        if not split.blocks:
            read.problems.append(f"splits[{index}] has no blocks")
        splits.append(split)
    return tuple(splits)


def _files(doc: dict[str, Any], read: _Reader) -> tuple[FileEntry, ...]:
    raw = doc.get("files")
    if not isinstance(raw, list):
        read.problems.append(f"files={_short(raw)} is not a list")
        return ()
    entries, names = [], set()
    for index, item in enumerate(raw):
        if not isinstance(item, dict):
            read.problems.append(f"files[{index}]={_short(item)} is not an object")
            continue
        entry = FileEntry(path=read.text(item, "path", _FILE_NAME),
                          sha256=read.text(item, "sha256", _SHA256),
                          size=read.integer(item, "size"), role=read.text(item, "role", _ROLE),
                          rank=read.integer(item, "rank"), layers=read.integers(item, "layers"))
        if entry.path in names or entry.path == MANIFEST:
            read.problems.append(f"files[{index}] path {entry.path!r} is listed twice")
        names.add(entry.path)
        entries.append(entry)
    return tuple(entries)


def read_manifest(step_dir: str) -> Manifest:
    """The manifest of a step directory; `CheckpointError` if absent (an incomplete save)."""
    path = os.path.join(step_dir, MANIFEST)
    try:
        raw = read_regular_file(path, _MAX_MANIFEST_BYTES)
    except UnreadableInputError as error:
        raise CheckpointError(f"{error}; not a manifest", path=path) from None
    except FileNotFoundError:
        raise CheckpointError(f"{step_dir} has no {MANIFEST}: the save did not complete (a "
                              "crash or kill while writing); load the root to follow "
                              f"'{LATEST}', or an earlier step directory", path=path) from None
    except OSError as error:
        raise CheckpointError(f"cannot read {path}: {error.strerror}", path=path) from None
    manifest = parse_manifest(raw, where=path)
    named = _STEP_PREFIX.match(os.path.basename(os.path.normpath(step_dir)))
    if named is not None and int(named.group(1)) != manifest.step:
        raise CheckpointError(
            f"{step_dir} is named for step {int(named.group(1))} but its {MANIFEST} records "
            f"step {manifest.step}: the directories were renamed or swapped; rename it "
            f"{step_name(manifest.step)} or load a step directory whose name agrees",
            path=path)
    return manifest


def verify_files(step_dir: str, entries: tuple[FileEntry, ...], *,
                 checksums: bool = True) -> None:
    """Every file present with its recorded size (and sha256 when `checksums`)."""
    for entry in entries:
        path = os.path.join(step_dir, entry.path)
        try:
            status = os.stat(path)
        except OSError:
            raise CheckpointError(f"{path} is missing: the checkpoint is incomplete; load an "
                                  "earlier step directory", path=path) from None
        if not stat.S_ISREG(status.st_mode):  # a FIFO would block the read, /dev/zero not end
            raise CheckpointError(f"{path} is not a regular file (a FIFO, a device or a "
                                  "directory was put there); load an earlier step directory",
                                  path=path)
        if status.st_size != entry.size:
            raise CheckpointError(f"{path} has {status.st_size} bytes, the manifest says "
                                  f"{entry.size}: the file is truncated or was replaced",
                                  path=path)
        try:
            digest = sha256_file(path, entry.size) if checksums else entry.sha256
        except (OSError, UnreadableInputError) as error:
            raise CheckpointError(f"cannot check {path}: {error}", path=path) from None
        if digest != entry.sha256:
            raise CheckpointError(f"{path} fails its sha256 check: the file is corrupt; load "
                                  "an earlier step directory", path=path)


def resolve_checkpoint(path: str) -> str:
    """The step directory to load: `path` itself if it holds a manifest, else the one its
    `latest` pointer names."""
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    pointer = os.path.join(path, LATEST)
    if _STEP_PREFIX.match(os.path.basename(os.path.normpath(path))) or glob.glob(
            os.path.join(path, "*.pt")):
        read_manifest(path)  # a step directory without its manifest: says the save was torn
    if not os.path.exists(pointer):
        steps = sorted(d for d in glob.glob(os.path.join(path, "step_*"))
                       if _STEP_NAME.fullmatch(os.path.basename(d)))
        hint = (f"; pass a step directory such as {steps[-1]}" if steps else
                "; pass a directory written by engine.save_checkpoint")
        if os.path.isdir(path) and steps:
            raise CheckpointError(f"{path} has no '{LATEST}' pointer{hint}", path=path)
        raise CheckpointError(f"no checkpoint at {path}: it has neither {MANIFEST} nor "
                              f"'{LATEST}'{hint}", path=path)
    try:
        name = read_pointer(pointer)
    except (OSError, ValueError) as error:  # UnicodeDecodeError, a FIFO, a huge file
        raise CheckpointError(f"cannot read {pointer}: {error}", path=pointer) from None
    if not _STEP_NAME.fullmatch(name):
        raise CheckpointError(f"{pointer} holds {_short(name)}, not a step directory name "
                              "such as step_000042; rewrite it or pass a step directory",
                              path=pointer)
    target = os.path.join(path, name)
    if not os.path.isdir(target):
        # A save that replaced an existing step directory crashed between its two renames:
        # the new copy (.partial-) or the old one (.old-) is complete (`checkpoint.commit`).
        candidates = [candidate for pattern in (".partial-*", ".old-*")
                      for candidate in sorted(glob.glob(os.path.join(path, name + pattern)))
                      if os.path.isfile(os.path.join(candidate, MANIFEST))]
        if not candidates:
            raise CheckpointError(f"{pointer} names {name!r} but {target} does not exist; "
                                  "pass a step directory explicitly", path=pointer)
        target = candidates[0]
    if signing_key() is not None:  # the signed `latest` names this run's manifest
        manifest = os.path.join(target, MANIFEST)
        try:
            raw = read_regular_file(manifest, _MAX_MANIFEST_BYTES)
        except (OSError, UnreadableInputError) as error:
            raise CheckpointError(f"cannot read {manifest}: {error}", path=manifest) from None
        check_pointer(pointer, name, parse_manifest(raw, where=manifest).run_id, raw)
    return target
