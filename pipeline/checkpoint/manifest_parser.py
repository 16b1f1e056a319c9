"""A manifest's bytes read strictly: its checksum, signature and every field checked."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from pipeline.checkpoint.atomic_files import sha256_bytes
from pipeline.checkpoint.manifest_bounds import bound_problems
from pipeline.checkpoint.manifest_schema import (
    FORMAT,
    MANIFEST,
    ROLES,
    VERSION,
    FileEntry,
    Manifest,
    SavedSplit,
)
from pipeline.checkpoint.signing import signing_key, verify_signature
from pipeline.errors import CheckpointError
from pipeline.files import UnreadableInputError, loads_json

__all__ = ["parse_manifest", "short_repr"]

_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_RUN_ID = re.compile(r"([0-9a-f]{16})?")
_ROLE = re.compile("|".join(ROLES))
_AXIS = re.compile("tp|ep")


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
            self.problems.append(f"{key}={short_repr(value)} is not a string{shape}")
            return ""
        return value

    def integers(self, doc: dict[str, Any], key: str) -> tuple[int, ...]:
        value = doc.get(key)
        if not isinstance(value, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
            self.problems.append(f"{key}={short_repr(value)} is not a list of ints >= 0")
            return ()
        return tuple(value)


def short_repr(value: object) -> str:
    """``repr(value)``, cut to 60 characters for an error message."""
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
        raise CheckpointError(f"{where} is format {short_repr(doc.get('format'))} version "
                              f"{short_repr(doc.get('version'))}; this pipesched reads {FORMAT!r} "
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
        read.problems.append(f"topology={short_repr(doc.get('topology'))} is not [pp, dp, tp] >= 1")
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
        read.problems.append(f"loss_scaler={short_repr(value)} is not null or a mapping of numbers")
        return None
    return {key: float(number) for key, number in value.items()}


def _splits(doc: dict[str, Any], read: _Reader) -> tuple[SavedSplit, ...]:
    raw = doc.get("splits", [])
    if not isinstance(raw, list):
        read.problems.append(f"splits={short_repr(raw)} is not a list")
        return ()
    splits = []
    for index, item in enumerate(raw):
        if not isinstance(item, dict):
            read.problems.append(f"splits[{index}]={short_repr(item)} is not an object")
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
        read.problems.append(f"files={short_repr(raw)} is not a list")
        return ()
    entries, names = [], set()
    for index, item in enumerate(raw):
        if not isinstance(item, dict):
            read.problems.append(f"files[{index}]={short_repr(item)} is not an object")
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
