"""The default process group from torchrun's environment, for an engine built outside `launch`."""

from __future__ import annotations

import os

import torch.distributed as dist

from pipeline.device import default_backend, process_group_timeout
from pipeline.device.staged_backend import backend_available

__all__ = ["TORCHRUN_VARIABLES", "init_from_torchrun"]

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun (and DeepSpeed's launcher) set for every process: env:// reads them."""


def init_from_torchrun(timeout: float) -> bool:
    """Initialise the default process group over env:// when torchrun's variables are set and
    none exists yet (as ``deepspeed.init_distributed()`` does); whether one exists now.

    The backend is `default_backend()`'s for LOCAL_WORLD_SIZE ranks on this host (gloo
    without CUDA); `timeout` bounds every collective."""
    if dist.is_initialized():
        return True
    if not all(name in os.environ for name in TORCHRUN_VARIABLES):
        return False
    backend = default_backend()
    backend_available(backend)  # registers the staged backend where it is named
    dist.init_process_group(backend, init_method="env://",
                            timeout=process_group_timeout(timeout))
    return True
