"""The one seam to accelerators: device, backend and timeout choice, synchronisation (CPU first)."""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable

import torch

__all__ = ["NCCL_PER_DEVICE", "STAGED_PER_DEVICE", "accelerator_name", "accelerator_rng_states",
           "backend_reason", "copy_from_host", "default_backend", "default_device",
           "device_memory_allocated",
           "device_problem", "host_buffer_like", "peak_memory_allocated", "process_group_timeout",
           "release_cached_memory", "reset_peak_memory", "seed_accelerator_rng",
           "set_accelerator_rng_states", "stage_to_host", "synchronize"]

NCCL_PER_DEVICE = "cpu:gloo,cuda:nccl"
"""A GPU per rank: CUDA tensors over NCCL, the CPU tensors of the step's small agreements (the
batch and finite votes, shape headers' bookkeeping) over gloo, which NCCL cannot carry."""

STAGED_PER_DEVICE = "cpu:gloo,cuda:pipesched_staged"
"""Ranks sharing a GPU: CPU tensors over gloo, CUDA tensors staged through pinned host memory
(`pipeline.device.staged_backend`)."""


def _has_cuda() -> bool:
    return torch.cuda.is_available()


def default_backend(ranks_on_host: int | None = None) -> str:
    """``gloo`` without CUDA; `NCCL_PER_DEVICE` when every rank of this host has a GPU of its
    own;
    `STAGED_PER_DEVICE` when more ranks than GPUs share the host, since NCCL refuses two
    ranks on one GPU ("Duplicate GPU detected"). `ranks_on_host` defaults to torchrun's
    LOCAL_WORLD_SIZE (1 when unset)."""
    if not _has_cuda():
        return "gloo"
    if ranks_on_host is None:
        ranks_on_host = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return NCCL_PER_DEVICE if ranks_on_host <= torch.cuda.device_count() else STAGED_PER_DEVICE


def backend_reason(backend: str, ranks_on_host: int) -> str:
    """One log line saying which transport `backend` is and why it was chosen."""
    if backend == STAGED_PER_DEVICE:
        return (f"pipesched: {ranks_on_host} ranks share {torch.cuda.device_count()} GPU(s) on "
                f"this host and NCCL refuses a GPU shared by two ranks: CUDA compute, messages "
                f"over gloo staged through pinned host memory ({backend})")
    return f"pipesched: process-group backend {backend}"


def stage_to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of `tensor` whose bytes are ready to send: pinned and synchronised with
    the stream that produced them for a CUDA tensor; a fresh copy for a CPU one (so a result
    never copied back shows, as it would on a GPU)."""
    if tensor.device.type == "cuda":
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        torch.cuda.current_stream(tensor.device).synchronize()  # gloo reads it from now on
        return host
    return tensor.detach().clone()


def host_buffer_like(tensor: torch.Tensor) -> torch.Tensor:
    """An empty host buffer that can receive `tensor`'s bytes (pinned for a CUDA tensor)."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.device.type == "cuda")


def copy_from_host(tensor: torch.Tensor, host: torch.Tensor) -> None:
    """Copy a received host buffer into `tensor`, queued on the current stream (the caching
    host allocator keeps the pinned buffer until the copy has run)."""
    tensor.copy_(host, non_blocking=tensor.device.type == "cuda")


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


def device_memory_allocated(device: torch.device) -> int | None:
    """Bytes the device's caching allocator has handed out to tensors in this process (None
    on a CPU, which has no such counter)."""
    if device.type == "cuda":
        synchronize(device)
        return int(torch.cuda.memory_allocated(device))
    return None


def accelerator_name(device: torch.device) -> str | None:
    """The accelerator's product name, e.g. "NVIDIA H100 80GB HBM3" (None on a CPU)."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    return None


def reset_peak_memory(device: torch.device) -> None:
    """Start `peak_memory_allocated` afresh (a no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_allocated(device: torch.device) -> int | None:
    """The most bytes the device's allocator has held for tensors since the last reset (None
    on a CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None


def release_cached_memory(device: torch.device) -> None:
    """Hand the caching allocator's free blocks back to the device (a no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


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
