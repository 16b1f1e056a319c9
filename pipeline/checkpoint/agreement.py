"""Collectives of a save or load: every rank's value, and one rank's refusal raised on all."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from pipeline.checkpoint.root_lock import CheckpointRootLockedError
from pipeline.errors import CheckpointError

__all__ = ["agree", "gather_from_ranks"]


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def gather_from_ranks(value: Any) -> list[Any]:
    """Collective: every rank's `value`, by rank (just `[value]` without a process group)."""
    if _world() == 1:
        return [value]
    gathered: list[Any] = [None] * _world()
    dist.all_gather_object(gathered, value)
    return gathered


def agree(error: CheckpointError | None, what: str) -> None:
    """Collective: raise `CheckpointError` on every rank if any rank had one (so no rank
    goes on with a checkpoint another rank refused); a `CheckpointRootLockedError` keeps its
    type and fields on every rank."""
    reported = gather_from_ranks(error)
    problems = [(rank, item) for rank, item in enumerate(reported) if item is not None]
    if problems:
        rank, first = problems[0]
        more = f" (and on {len(problems) - 1} more rank(s))" if len(problems) > 1 else ""
        message = f"{what} failed on rank {rank}{more}: {first}"
        if isinstance(first, CheckpointRootLockedError):
            raise CheckpointRootLockedError(message, root=first.root,
                                            holder_pid=first.holder_pid,
                                            holder_host=first.holder_host)
        raise CheckpointError(message, path=first.path)
