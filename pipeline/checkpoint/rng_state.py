"""Every random generator a rank uses, captured and restored so a resumed run draws the same
numbers (dropout masks, data shuffles) as an uninterrupted one."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from pipeline.device import accelerator_rng_states, set_accelerator_rng_states

__all__ = ["capture_rng", "restore_rng"]


def capture_rng() -> dict[str, Any]:
    """torch CPU, accelerator, Python and numpy generator states, in types
    `torch.load(weights_only=True)` accepts (numpy's key array becomes a tensor)."""
    kind, keys, position, has_gauss, cached = np.random.get_state(legacy=True)
    return {"torch": torch.get_rng_state(), "accelerator": accelerator_rng_states(),
            "python": random.getstate(),
            "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys).astype(
                np.int64)), "position": int(position), "has_gauss": int(has_gauss),
                "cached": float(cached)}}


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what `capture_rng` returned."""
    torch.set_rng_state(state["torch"])
    set_accelerator_rng_states(list(state["accelerator"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    saved = state["numpy"]
    np.random.set_state((saved["kind"], saved["keys"].numpy().astype(np.uint32),
                         saved["position"], saved["has_gauss"], saved["cached"]))
