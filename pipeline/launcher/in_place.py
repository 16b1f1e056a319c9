"""`launch` under torchrun: `fn` runs in this process, over env://, and ends with the agent."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from pipeline.device import default_backend, process_group_timeout
from pipeline.errors import PipelineConfigError
from pipeline.launcher.rank_worker import prepared_backend, rank_report
from pipeline.supervision.failure import Watchdog, report_failure
from pipeline.supervision.orphans import identity_of, remove_on_sigterm, watch_launcher

__all__ = ["run_in_place"]

T = TypeVar("T")


def run_in_place(fn: Callable[..., T], world_size: int, args: tuple[Any, ...], timeout: float,
                 backend: str | None, threads: int | None) -> T:
    env_world = int(os.environ["WORLD_SIZE"])
    if env_world != world_size:
        raise PipelineConfigError(f"launch(world_size={world_size}) runs under torchrun with "
                                  f"WORLD_SIZE={env_world}; make them agree")
    torchrun_directories = _torchrun_directories()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's agent is our parent: end with it
        watch_launcher(identity_of(os.getppid()), torchrun_directories)
    if threads:
        torch.set_num_threads(threads)
    created = not dist.is_initialized()
    if created:
        ranks_on_host = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        dist.init_process_group(prepared_backend(backend or default_backend(), ranks_on_host,
                                                 int(os.environ["RANK"])),
                                init_method="env://", timeout=process_group_timeout(timeout))
    rank = dist.get_rank()
    watchdog = Watchdog(rank).start()
    try:
        with remove_on_sigterm(torchrun_directories):  # the agent stopping us leaves nothing
            return fn(*args)
    except BaseException as error:
        report = rank_report(rank, dist.get_world_size(), error)
        if report.kind in ("error", "exit"):
            report_failure(rank, report.instruction, report.message)
        raise
    finally:
        watchdog.stop()
        if created:
            dist.destroy_process_group()


def _torchrun_directories() -> list[str]:
    """The temporary log directory torchrun's agent made for this run (it cannot remove it
    once killed): ``<tmp>/torchelastic_*/<run id>/attempt_<n>/<rank>/error.json``."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(error_file))))
    inside_tmp = os.path.dirname(root) == os.path.realpath(tempfile.gettempdir()) or \
        os.path.dirname(root) == tempfile.gettempdir()
    return [root] if error_file and inside_tmp and \
        os.path.basename(root).startswith("torchelastic_") else []
