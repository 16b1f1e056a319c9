"""The one seam to accelerators: device, backend and timeout choice, synchronisation (CPU first)."""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable

import torch

__all__ = ["accelerator_rng_states", "default_backend", "default_device", "device_problem",
           "process_group_timeout", "seed_accelerator_rng", "set_accelerator_rng_states",
           "synchronize"]


def _has_cuda() -> bool:
    return torch.cuda.is_available()


def default_backend() -> str:
    """``nccl`` when CUDA is present, else ``gloo``."""
    return "nccl" if _has_cuda() else "gloo"


def process_group_timeout(seconds: float) -> datetime.timedelta:
    """The timeout every blocking collective and wait of this run honours."""
    from pipeline.limits import check_timeout

    return datetime.timedelta(seconds=check_timeout(seconds))


def default_device(local_rank: int | None = None) -> torch.device:
    """This process's device: its local GPU when CUDA is present (selected), else the CPU."""
    if not _has_cuda():
        return torch.device("cpu")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def device_problem(device: torch.device) -> str | None:
    """Why this process cannot run on `device` (None when it can)."""
    if device.type == "cuda" and not _has_cuda():
        return (f"device={device} but this machine has no CUDA device; omit device (CPU here, "
                f"the local GPU where there is one) or pass torch.device('cpu')")
    if device.type not in ("cpu", "cuda"):
        return f"device={device} is not supported; use torch.device('cpu') or a CUDA device"
    return None


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels on `device` (a no-op on the CPU), so timings are real."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def accelerator_rng_states() -> list[torch.Tensor]:
    """Every visible GPU's generator state (empty on a CPU-only machine)."""
    return list(torch.cuda.get_rng_state_all()) if _has_cuda() else []


def set_accelerator_rng_states(states: list[torch.Tensor]) -> None:
    """Restore `accelerator_rng_states()`; ignored when there is no GPU to restore."""
    if states and _has_cuda():
        torch.cuda.set_rng_state_all(states)


def seed_accelerator_rng(device: torch.device, seed: int) -> Callable[[], None]:
    """Seed `device`'s own generator (no-op on the CPU) and return what puts its previous
    state back (`pipeline.model.layer_rng` runs each layer under a seed this way)."""
    if device.type == "cpu":
        return _nothing
    backend = torch.get_device_module(device.type)
    index = device.index if device.index is not None else backend.current_device()
    saved = backend.get_rng_state(index)
    with backend.device(index):
        backend.manual_seed(seed)
    return lambda: backend.set_rng_state(saved, index)


def _nothing() -> None:
    pass
