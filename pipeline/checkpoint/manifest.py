"""The checkpoint manifest on disk: which step directory to load, its manifest, its files checked.

Layout of a checkpoint root (see `pipeline.checkpoint.save` for how it is written)::

    root/
      latest                      one line: the name of the newest complete step directory
      step_000042/
        layer_03-model_states.pt  weights of global layer 3 (tp > 1: layer_03-tp_01-...)
        optim_rank_0001.pt        rank 1's optimizer state, per (layer, parameter) and range
        rng_rank_0001.pt          rank 1's random generators
        manifest.json             written last: topology, schedule, step, files + sha256

The manifest's fields and JSON form are `pipeline.checkpoint.manifest_schema`, its strict
reading `pipeline.checkpoint.manifest_parser`; both are re-exported here. Pure Python (no
torch), so `pipesched verify-checkpoint` and the fuzz tests use it alone.
"""

from __future__ import annotations

import glob
import os
import re
import stat

from pipeline.checkpoint.atomic_files import read_pointer, sha256_file
from pipeline.checkpoint.manifest_parser import parse_manifest, short_repr
from pipeline.checkpoint.manifest_schema import (
    FORMAT,
    LATEST,
    MANIFEST,
    VERSION,
    FileEntry,
    Manifest,
    SavedSplit,
    dump_manifest,
    step_name,
)
from pipeline.checkpoint.pointer import check_pointer
from pipeline.checkpoint.signing import signing_key
from pipeline.errors import CheckpointError
from pipeline.files import UnreadableInputError, read_regular_file

__all__ = ["FORMAT", "LATEST", "MANIFEST", "VERSION", "FileEntry", "Manifest", "SavedSplit",
           "dump_manifest", "parse_manifest", "read_manifest", "resolve_checkpoint", "step_name",
           "verify_files"]

_STEP_NAME = re.compile(r"step_\d{6,}")
_STEP_PREFIX = re.compile(r"step_(\d{6,})(\.|$)")
_MAX_MANIFEST_BYTES = 64 << 20


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
        raise CheckpointError(f"{pointer} holds {short_repr(name)}, not a step directory name "
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
