"""The client state DeepSpeed's ``save_checkpoint(client_state=)`` keeps with a checkpoint: a
file inside the step directory, listed (and signed) in its manifest, written before the commit."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from pipeline.checkpoint.atomic_files import sha256_bytes

__all__ = ["CLIENT_STATE", "client_state_bytes", "read_client_state"]

CLIENT_STATE = "client_state.pt"
"""The client state's file in a step directory (role 'client' in its manifest)."""


def client_state_bytes(extra: dict[str, Any]) -> bytes:
    """`extra` (plain types and tensors) as the bytes of `CLIENT_STATE`."""
    buffer = io.BytesIO()
    torch.save(extra, buffer)
    return buffer.getvalue()


def read_client_state(step_dir: Path) -> dict[str, Any]:
    """The client state saved in a step directory ({} if its manifest lists none), read
    safely: a regular file of the size and sha256 its (signed) manifest records, loaded with
    ``weights_only=True`` (tensors and plain containers only: a crafted file runs no code)."""
    from pipeline.checkpoint.manifest import read_manifest
    from pipeline.checkpoint.signing import KEY_ENV, signing_key
    from pipeline.errors import CheckpointError
    from pipeline.files import UnreadableInputError, read_regular_file

    path = step_dir / CLIENT_STATE
    entry = next((entry for entry in read_manifest(str(step_dir)).files
                  if entry.path == CLIENT_STATE), None)
    if entry is None:
        if not path.exists():
            return {}
        if signing_key() is not None:  # written beside the manifest by an older pipesched
            raise CheckpointError(
                f"{path} is not listed in its manifest, so the signature does not cover it, "
                f"and {KEY_ENV} is set; save the checkpoint again with this pipesched, or "
                "load it without the key only if you trust where it came from", path=str(path))
    try:
        data = read_regular_file(path, entry.size if entry is not None else _CLIENT_STATE_BYTES)
    except (OSError, UnreadableInputError) as error:
        raise CheckpointError(f"cannot read {path}: {error}", path=str(path)) from None
    if entry is not None and (len(data) != entry.size or sha256_bytes(data) != entry.sha256):
        raise CheckpointError(f"{path} fails its sha256 check: it was altered or is corrupt; "
                              "load an earlier step directory", path=str(path))
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


_CLIENT_STATE_BYTES = 256 << 20
"""The most an unlisted (older, unsigned) client state may hold."""
