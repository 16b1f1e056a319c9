"""Every random generator a rank uses, captured and restored so a resumed run draws the same
numbers (dropout masks, data shuffles) as an uninterrupted one."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from pipeline.device import accelerator_rng_states, set_accelerator_rng_states
from pipeline.errors import CheckpointError

__all__ = ["capture_rng", "check_rng", "restore_rng"]

_KEYS = ("accelerator", "numpy", "python", "torch")


def capture_rng() -> dict[str, Any]:
    """torch CPU, accelerator, Python and numpy generator states, in types
    `torch.load(weights_only=True)` accepts (numpy's key array becomes a tensor)."""
    kind, keys, position, has_gauss, cached = np.random.get_state(legacy=True)
    return {"torch": torch.get_rng_state(), "accelerator": accelerator_rng_states(),
            "python": random.getstate(),
            "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys).astype(
                np.int64)), "position": int(position), "has_gauss": int(has_gauss),
                "cached": float(cached)}}


def check_rng(state: Any, *, where: str) -> dict[str, Any]:
    """`state` if `restore_rng` will take it, else `CheckpointError` naming `where`.

    Each part is set into a scratch generator of its kind (a fresh `torch.Generator`,
    `random.Random`, `numpy.random.RandomState`): the libraries' own checks, without touching
    the process's generators. So a load refuses a wrong layout before it changes anything.
    """
    if not isinstance(state, dict) or sorted(state) != sorted(_KEYS):
        keys = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"{where} is not a generator state: it holds {keys}, expected "
                              f"the keys {list(_KEYS)}; it was not written by this pipesched "
                              "or was edited", path=where)
    part = "torch"
    try:
        torch.Generator().set_state(state["torch"])
        part = "accelerator"
        _check_accelerator(state["accelerator"])
        part = "python"
        version, internal, gauss = state["python"]
        random.Random().setstate((version, tuple(internal), gauss))
        part = "numpy"
        np.random.RandomState().set_state(_numpy_state(state["numpy"]))
    except (TypeError, ValueError, RuntimeError, KeyError, IndexError, AttributeError,
            OverflowError) as error:
        raise CheckpointError(f"{where}: its {part!r} generator state is not one this machine's "
                              f"generators take ({type(error).__name__}: {str(error)[:160]}); "
                              "it was not written by this pipesched or was edited: load an "
                              "earlier step directory", path=where) from None
    return state


def _check_accelerator(states: Any) -> None:
    if not isinstance(states, list | tuple) or not all(
            isinstance(s, torch.Tensor) and s.dtype == torch.uint8 for s in states):
        raise TypeError(f"expected a list of uint8 tensors, got {type(states).__name__}")
    here = accelerator_rng_states()
    if here and states and len(states) != len(here):
        raise ValueError(f"it holds {len(states)} device states, this machine has {len(here)}")


def _numpy_state(saved: Any) -> tuple[str, np.ndarray, int, int, float]:
    return (saved["kind"], saved["keys"].numpy().astype(np.uint32), saved["position"],
            saved["has_gauss"], saved["cached"])


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what `capture_rng` returned (checked by `check_rng`)."""
    torch.set_rng_state(state["torch"])
    set_accelerator_rng_states(list(state["accelerator"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(_numpy_state(state["numpy"]))
