"""Optional checkpoint signing: with a key in `KEY_ENV`, saves carry an HMAC-SHA256 of the
manifest (which holds every file's sha256) and loads refuse anything unsigned or altered.

Trust model: the sha256 checksums catch damage (a torn write, a flipped byte), not intent:
whoever can write the folder can recompute them. Every file pipesched loads is read with
``torch.load(weights_only=True)``, which builds tensors and plain containers and runs no code,
so a folder from elsewhere cannot execute anything; but without a key it can still hold
well-formed wrong contents (swapped layers, another dtype, another step). With
``PIPESCHED_CHECKPOINT_KEY`` set, only folders saved with that key load.
"""

from __future__ import annotations

import hashlib
import hmac
import os

__all__ = ["KEY_ENV", "sign", "signing_key", "verify_signature"]

KEY_ENV = "PIPESCHED_CHECKPOINT_KEY"
"""Environment variable holding the signing key (any text; use 32 random bytes' hex)."""


def signing_key() -> bytes | None:
    """The key from `KEY_ENV`, or None when it is unset or empty (no signing)."""
    text = os.environ.get(KEY_ENV, "")
    return text.encode() if text else None


def sign(data: bytes, key: bytes) -> str:
    """HMAC-SHA256 of `data` under `key`, as hex."""
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def verify_signature(data: bytes, signature: object, key: bytes) -> str | None:
    """None if `signature` is `data`'s under `key`; else why not (for an error message)."""
    if not isinstance(signature, str) or not signature:
        return (f"it is not signed, and {KEY_ENV} is set: only checkpoints saved with that key "
                "load; load it without the key only if you trust where it came from")
    if not hmac.compare_digest(signature, sign(data, key)):
        return ("its signature does not match: it was altered after saving, or signed with "
                f"another key; check {KEY_ENV}")
    return None
