"""Helpers the benchmarks share."""

from __future__ import annotations

import sys

__all__ = ["deepspeed_available"]


def deepspeed_available(wanted: bool, without: str) -> bool:
    """True when DeepSpeed is wanted and importable; otherwise say `without` on stderr."""
    if not wanted:
        return False
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        print(f"DeepSpeed is not installed: {without}", file=sys.stderr)
        return False
    return True
