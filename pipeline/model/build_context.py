"""How a layer gets its process groups: the rank's `ProcessGroups` while its layers are built.

`PipelineModule.materialize` builds this rank's layers inside `building_with(groups)`. A
layer factory with a parameter named ``group`` (the convention of `ColumnParallelLinear`,
`RowParallelLinear`, `VocabParallelEmbedding`, `ParallelTransformerBlock`) that the spec
does not fill receives the rank's tensor-parallel group, so

    LayerSpec(ColumnParallelLinear, 512, 2048)          # group filled in at build time

builds this rank's shard. Outside `materialize` (the single-process reference, parameter
counting for the partition) and in a pure pipeline the group is None, which the
tensor-parallel layers read as tp = 1: the full layer. A custom layer that needs other
groups (dp, pp) calls `current_process_groups()` in its constructor.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from pipeline.parallel.groups import ProcessGroups

__all__ = ["GROUP_PARAMETER", "building_with", "call_with_group", "current_process_groups"]

GROUP_PARAMETER = "group"
"""Name of the factory parameter that receives the tensor-parallel group."""

_T = TypeVar("_T")
# A context variable, not a module global: the groups are scoped to one `materialize` call
# (the topology is passed in, never ambient state that outlives the build).
_CURRENT: ContextVar[ProcessGroups | None] = ContextVar("pipesched_build_groups", default=None)


@contextmanager
def building_with(groups: ProcessGroups | None) -> Iterator[None]:
    """Build layers inside this block with `groups` as the rank's process groups."""
    token = _CURRENT.set(groups)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_process_groups() -> ProcessGroups | None:
    """The rank's process groups while `PipelineModule.materialize` builds layers; None
    outside it or when the engine runs a pure pipeline (no dp, tp or ZeRO groups)."""
    return _CURRENT.get()


def call_with_group(factory: Callable[..., _T], args: tuple[Any, ...],
                    kwargs: Mapping[str, Any]) -> _T:
    """``factory(*args, **kwargs)``, adding ``group=<tensor-parallel group>`` when the factory
    has a ``group`` parameter the arguments leave unfilled (given arguments always win)."""
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # builtins without a signature take no group
        return factory(*args, **kwargs)
    wanted = parameters.get(GROUP_PARAMETER)
    if wanted is None or wanted.kind is inspect.Parameter.POSITIONAL_ONLY:
        return factory(*args, **kwargs)
    try:
        bound = inspect.signature(factory).bind_partial(*args, **kwargs)
    except TypeError:  # a wrong call: let the factory's own error say what is wrong
        return factory(*args, **kwargs)
    if GROUP_PARAMETER in bound.arguments:
        return factory(*args, **kwargs)
    groups = _CURRENT.get()
    return factory(*args, **{**kwargs, GROUP_PARAMETER: None if groups is None
                             else groups.tp_group})
