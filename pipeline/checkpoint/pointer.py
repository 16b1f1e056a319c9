"""The `latest` pointer: the name of the newest step directory, and with a signing key a
signed record binding that name to the run and to the exact manifest it commits.

Format (text)::

    step_000042                                   <- the name (the only line without a key)
    run=3f9c0a1b77d2e410 manifest=<sha256> signature=<hmac>

Why the record. A manifest's signature proves its bytes came from a holder of the key, but
not which run or which moment: with the same key a step directory copied from another run,
or ``echo step_000004 > latest`` (a rollback), would load. With a key set, `latest` must carry
a record signed with it, naming the run and the sha256 of the manifest it points at; a load
through the root checks both. What a key still does not prevent (docs/reliability.md): putting
back an older `latest` file together with its step directory (a replay of the run's own past),
and passing a step directory explicitly, which trusts that directory's run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pipeline.checkpoint.atomic_files import read_pointer_lines, sha256_bytes, write_lines
from pipeline.checkpoint.signing import KEY_ENV, sign, signing_key
from pipeline.errors import CheckpointError

__all__ = ["PointerRecord", "check_pointer", "read_run_id", "write_latest"]

_RECORD = re.compile(r"run=([0-9a-f]{16}) manifest=([0-9a-f]{64}) signature=([0-9a-f]{64})")


@dataclass(frozen=True)
class PointerRecord:
    """The signed line of a `latest` pointer."""

    run_id: str
    manifest_sha256: str
    signature: str


def _signed_text(name: str, run_id: str, manifest_sha256: str) -> bytes:
    return f"pipesched-latest\n{name}\n{run_id}\n{manifest_sha256}".encode()


def write_latest(path: str, name: str, run_id: str, manifest: bytes, *,
                 dir_fd: int | None = None) -> None:
    """Point `path` at step directory `name` (crash-safe); with a key, also the signed record.
    With `dir_fd`, `path` is a bare name in the directory that descriptor holds open."""
    key = signing_key()
    lines = [name]
    if key is not None:
        digest = sha256_bytes(manifest)
        lines.append(f"run={run_id} manifest={digest} "
                     f"signature={sign(_signed_text(name, run_id, digest), key)}")
    write_lines(path, lines, dir_fd=dir_fd)


def _record(lines: list[str]) -> PointerRecord | None:
    matched = _RECORD.fullmatch(lines[1].strip()) if len(lines) > 1 else None
    return None if matched is None else PointerRecord(*matched.groups())


def read_run_id(path: str) -> str | None:
    """The run id a `latest` pointer records (None without one, or unreadable)."""
    try:
        record = _record(read_pointer_lines(path))
    except (OSError, ValueError):
        return None
    return None if record is None else record.run_id


def check_pointer(path: str, name: str, run_id: str, manifest: bytes) -> None:
    """With a key: `CheckpointError` unless `path` holds a record signed with it for `name`,
    the manifest's `run_id` and these manifest bytes. Without a key, nothing to check."""
    key = signing_key()
    if key is None:
        return
    try:
        record = _record(read_pointer_lines(path))
    except (OSError, ValueError) as error:
        raise CheckpointError(f"cannot read {path}: {error}", path=path) from None
    if record is None:
        raise CheckpointError(
            f"{path} is not signed, and {KEY_ENV} is set: it was written by hand or by a "
            "save without the key (a rollback is done by loading a step directory "
            "explicitly, not by editing 'latest')", path=path)
    expected = sign(_signed_text(name, record.run_id, record.manifest_sha256), key)
    if record.signature != expected:
        raise CheckpointError(f"{path}: its signature does not match (edited, or signed with "
                              f"another key); check {KEY_ENV}", path=path)
    if record.run_id != run_id or record.manifest_sha256 != sha256_bytes(manifest):
        raise CheckpointError(
            f"{path} names {name} of run {record.run_id}, but that directory holds a "
            f"checkpoint of run {run_id or '(none)'} or another manifest: it was copied from "
            "another run or replaced; load a step directory explicitly if you trust it",
            path=path)
