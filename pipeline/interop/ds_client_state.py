"""The client state DeepSpeed's ``save_checkpoint(client_state=)`` keeps beside a checkpoint."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

__all__ = ["read_client_state", "write_client_state"]

_CLIENT_STATE = "client_state.pt"
_CLIENT_STATE_BYTES = 256 << 20


def _client_signed_bytes(step_dir: Path, data: bytes) -> bytes:
    """What a client state's signature covers: its bytes and its step's manifest, so that
    a signed client state cannot be moved to another step directory."""
    from pipeline.checkpoint.atomic_files import sha256_bytes

    manifest = (step_dir / "manifest.json").read_bytes()
    return sha256_bytes(manifest).encode() + sha256_bytes(data).encode()


def write_client_state(step_dir: Path, extra: dict[str, Any]) -> None:
    """Save `extra` (plain types and tensors) beside the checkpoint, signed when a key is
    set (`pipeline.checkpoint.signing`)."""
    from pipeline.checkpoint.signing import sign, signing_key

    buffer = io.BytesIO()
    torch.save(extra, buffer)
    data = buffer.getvalue()
    (step_dir / _CLIENT_STATE).write_bytes(data)
    key = signing_key()
    if key is not None:
        (step_dir / (_CLIENT_STATE + ".sig")).write_text(
            sign(_client_signed_bytes(step_dir, data), key))


def read_client_state(step_dir: Path) -> dict[str, Any]:
    """The client state saved beside a checkpoint ({} if none), read safely: bounded, with
    ``weights_only=True`` (tensors and plain containers only: a crafted file runs no
    code), and, with a signing key set, only if signed by it."""
    from pipeline.checkpoint.signing import signing_key, verify_signature
    from pipeline.errors import CheckpointError
    from pipeline.files import read_regular_file

    path = step_dir / _CLIENT_STATE
    if not path.exists():
        return {}
    try:
        data = read_regular_file(path, _CLIENT_STATE_BYTES)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"cannot read {path}: {error}", path=str(path)) from None
    key = signing_key()
    if key is not None:
        signature_path = step_dir / (_CLIENT_STATE + ".sig")
        try:
            signature: str | None = read_regular_file(signature_path, 1024).decode().strip()
        except (OSError, ValueError):
            signature = None
        refusal = verify_signature(_client_signed_bytes(step_dir, data), signature, key)
        if refusal is not None:
            raise CheckpointError(f"{path}: {refusal}", path=str(path))
    try:
        extra = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:  # torch.load raises many types; all mean the same here
        raise CheckpointError(
            f"{path} cannot be read safely ({type(error).__name__}: {str(error)[:200]}); "
            "client_state must hold tensors and plain Python values (dict, list, str, "
            "numbers), which load without running code", path=str(path)) from None
    if not isinstance(extra, dict):
        raise CheckpointError(f"{path} holds a {type(extra).__name__}, not the client-state "
                              "dict save_checkpoint writes", path=str(path))
    return extra
