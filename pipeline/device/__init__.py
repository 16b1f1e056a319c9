"""The device room: the one seam to accelerators (`accelerator`) and the staged gloo backend of
ranks that share a GPU (`staged_backend`); `pipeline.device` re-exports the seam."""

from pipeline.device.accelerator import (
    NCCL_PER_DEVICE,
    STAGED_PER_DEVICE,
    accelerator_rng_states,
    backend_reason,
    copy_from_host,
    default_backend,
    default_device,
    device_memory_allocated,
    device_problem,
    host_buffer_like,
    peak_memory_allocated,
    process_group_timeout,
    release_cached_memory,
    reset_peak_memory,
    seed_accelerator_rng,
    set_accelerator_rng_states,
    stage_to_host,
    synchronize,
)

__all__ = [
    "NCCL_PER_DEVICE",
    "STAGED_PER_DEVICE",
    "accelerator_rng_states",
    "backend_reason",
    "copy_from_host",
    "default_backend",
    "default_device",
    "device_memory_allocated",
    "device_problem",
    "host_buffer_like",
    "peak_memory_allocated",
    "process_group_timeout",
    "release_cached_memory",
    "reset_peak_memory",
    "seed_accelerator_rng",
    "set_accelerator_rng_states",
    "stage_to_host",
    "synchronize",
]
