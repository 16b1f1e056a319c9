"""ZeRO-1 optimizer state to and from per-parameter pieces, so any dp size can load it.

Legend (as in `pipeline.parallel.zero`): d data-parallel size, r this rank's index in the dp group,
a region = one flat buffer of parameters laid end to end at `offsets`, padded to d·S with
S = ceil(N / d); rank r's master shard and optimizer state cover elements [r·S, (r+1)·S).

Written against `ShardedOptimizer`'s public surface only (`optimizer`, `dp_size`,
`dp_rank`) and its documented layout, recomputed here from the same `params_by_stage`
the optimizer was built with. The layout is checked against the live object (master sizes,
each parameter's offset in its flat buffer) so a change in `pipeline.parallel.zero` fails loudly
instead of scrambling the state. A saved piece is the overlap of one parameter's element
range with this rank's shard; loading under another d re-slices those pieces.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeline.checkpoint.optimizer_state import Assembled, ParamKey, make_piece
from pipeline.errors import CheckpointError
from pipeline.parallel.zero import ShardedOptimizer

__all__ = ["ZeroRegion", "export_zero", "import_zero", "wanted_ranges", "zero_layout"]


@dataclass(frozen=True)
class ZeroRegion:
    """One flat buffer: its parameters (key, parameter, offset) and shard size S."""

    params: tuple[tuple[ParamKey, nn.Parameter, int], ...]
    shard_size: int


def zero_layout(sharded: ShardedOptimizer,
                params_by_stage: Mapping[int, Sequence[nn.Parameter]],
                keys: Mapping[int, ParamKey]) -> list[ZeroRegion]:
    """The regions `ShardedOptimizer` builds from `params_by_stage`, checked against it."""
    regions, seen = [], set()
    for stage in sorted(params_by_stage):  # the construction order of `ShardedOptimizer`
        entries, offset = [], 0
        for param in params_by_stage[stage]:
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                entries.append((keys[id(param)], param, offset))
                offset += param.numel()
        if entries:
            regions.append(ZeroRegion(tuple(entries), math.ceil(offset / sharded.dp_size)))
    masters = _masters(sharded)
    sizes = [region.shard_size for region in regions]
    problems = [] if [m.numel() for m in masters] == sizes else [
        f"its master shards have {[m.numel() for m in masters]} elements, the layout {sizes}"]
    for region in regions:
        base = region.params[0][1].storage_offset()
        problems += [f"layer {key[0]} {key[1]!r} sits at {param.storage_offset() - base}, "
                     f"not {offset}" for key, param, offset in region.params
                     if param.storage_offset() - base != offset]
    if problems:
        raise CheckpointError("ShardedOptimizer's layout is not the one "
                              "pipeline.checkpoint.zero_state expects ("
                              + "; ".join(problems[:4]) + "); pass the "
                              "params_by_stage it was built with, or update zero_state to "
                              "pipeline.parallel.zero", path="<ShardedOptimizer>")
    return regions


def _masters(sharded: ShardedOptimizer) -> list[torch.Tensor]:
    return [p for group in sharded.optimizer.param_groups for p in group["params"]]


def _overlaps(region: ZeroRegion, dp_rank: int
              ) -> list[tuple[ParamKey, nn.Parameter, slice, slice]]:
    """(key, parameter, its element range, the master's range) where the shard meets it."""
    first, last = dp_rank * region.shard_size, (dp_rank + 1) * region.shard_size
    result = []
    for key, param, offset in region.params:
        lo, hi = max(first, offset), min(last, offset + param.numel())
        if lo < hi:
            result.append((key, param, slice(lo - offset, hi - offset), slice(lo - first,
                                                                              hi - first)))
    return result


def export_zero(sharded: ShardedOptimizer, regions: Sequence[ZeroRegion]) -> list[dict[str, Any]]:
    """This rank's pieces: per parameter its shard range, master values and state."""
    pieces = []
    for region, master in zip(regions, _masters(sharded)):
        state = sharded.optimizer.state.get(master, {})
        per_element = {n: v for n, v in state.items()
                       if isinstance(v, torch.Tensor) and v.numel() == master.numel()
                       and v.dim() > 0}
        whole = {n: v for n, v in state.items() if n not in per_element}
        for key, param, own, shard in _overlaps(region, sharded.dp_rank):
            pieces.append(make_piece(key, param.shape, own.start, own.stop,
                                     {n: v.reshape(-1)[shard] for n, v in per_element.items()},
                                     whole, master=master.detach().reshape(-1)[shard]))
    return pieces


def wanted_ranges(sharded: ShardedOptimizer, regions: Sequence[ZeroRegion]
                  ) -> dict[ParamKey, tuple[int, int]]:
    """Per parameter, the element range this rank's shard needs."""
    return {key: (own.start, own.stop) for region in regions
            for key, _, own, _ in _overlaps(region, sharded.dp_rank)}


def import_zero(sharded: ShardedOptimizer, regions: Sequence[ZeroRegion],
                state: Mapping[ParamKey, Assembled], hyper: Sequence[Mapping[str, Any]], *,
                where: str) -> None:
    """Fill this rank's master shards and optimizer state from assembled pieces.

    Parameters must hold the checkpoint's weights already: a master range the pieces do not
    carry (a checkpoint from a plain optimizer) is taken from them in fp32.
    """
    loaded: dict[int, dict[str, Any]] = {}
    for index, (region, master) in enumerate(zip(regions, _masters(sharded))):
        values: dict[str, torch.Tensor] = {}
        whole: dict[str, Any] = {}
        for key, param, own, shard in _overlaps(region, sharded.dp_rank):
            entry = state.get(key)
            source = None if entry is None else entry.master
            with torch.no_grad():
                master.reshape(-1)[shard] = (param.detach().reshape(-1)[own] if source is None
                                             else source).to(master.dtype)
            if entry is None:
                continue
            for name, flat in entry.sliced.items():
                values.setdefault(name, torch.zeros(master.numel(), dtype=flat.dtype))[shard] = flat
            for name, value in entry.whole.items():
                whole.setdefault(name, value)
        if values or whole:
            loaded[index] = {**{n: v.reshape(master.shape) for n, v in values.items()}, **whole}
    groups = sharded.optimizer.state_dict()["param_groups"]
    if hyper and len(hyper) == len(groups):
        groups = [{**saved, "params": group["params"]} for saved, group in zip(hyper, groups)]
    try:
        sharded.optimizer.load_state_dict({"state": loaded, "param_groups": groups})
    except (ValueError, KeyError, RuntimeError) as error:
        raise CheckpointError(f"{where}: the ZeRO inner optimizer refused the saved state "
                              f"({error}); build the same optimizer class as the saving job",
                              path=where) from error
