"""ZeRO-1 optimizer state to and from per-parameter pieces, so any dp size can load it.

Legend (as in `pipeline.parallel.zero_layout`): d data-parallel size, r this rank's index in the
dp group, a region = one flat buffer of parameters laid end to end at `offsets`, cut into k
buckets of d·s elements; rank r's (k, s) master shard and optimizer state cover the r-th d-th
of every bucket.

Written against `ShardedOptimizer`'s public surface (`optimizer`, `dp_rank`, `layouts`); the
regions' parameters are recomputed here from the same `params_by_stage` the optimizer was built
with, and checked against the live object (master shapes, each parameter's offset in its flat
buffer) so a change in `pipeline.parallel.zero` fails loudly instead of scrambling the state. A
saved piece is the overlap of one parameter's element range with one bucket's piece of this
rank's shard (the inner optimizer steps exactly these pieces, `pipeline.parallel.zero_groups`);
loading under another d (or from a checkpoint cut by the earlier one-range-per-
rank layout: the pieces do not depend on the layout) re-slices those pieces. An
`ExpertShardedOptimizer` is two such optimizers (dense over dp, experts over the
expert-data-parallel group) stepping one inner optimizer: each region belongs to one half.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeline.checkpoint.optimizer_state import Assembled, ParamKey, make_piece
from pipeline.errors import CheckpointError
from pipeline.parallel.expert_reduction import split_expert_parameters
from pipeline.parallel.expert_zero import ExpertShardedOptimizer
from pipeline.parallel.zero import ShardedOptimizer
from pipeline.parallel.zero_layout import ShardLayout

__all__ = ["ZeroRegion", "export_zero", "import_zero", "wanted_ranges", "zero_layout"]


@dataclass(frozen=True)
class ZeroRegion:
    """One flat buffer: its parameters (key, parameter, offset), its `ShardLayout` and the
    `ShardedOptimizer` that holds it (a half of an `ExpertShardedOptimizer`)."""

    params: tuple[tuple[ParamKey, nn.Parameter, int], ...]
    layout: ShardLayout
    owner: ShardedOptimizer


_Overlap = tuple[ParamKey, nn.Parameter, slice, int, slice]
"""(key, parameter, a range of its elements, bucket b, the same range in row b of the shard)."""


def _halves(sharded: ShardedOptimizer, params_by_stage: Mapping[int, Sequence[nn.Parameter]]
            ) -> list[tuple[ShardedOptimizer, Mapping[int, Sequence[nn.Parameter]]]]:
    """Each `ShardedOptimizer` inside `sharded` and the parameters it was built with."""
    if not isinstance(sharded, ExpertShardedOptimizer):
        return [(sharded, params_by_stage)]
    split = {stage: split_expert_parameters(params) for stage, params in params_by_stage.items()}
    halves: list[tuple[ShardedOptimizer, Mapping[int, Sequence[nn.Parameter]]]] = [
        (sharded.dense, {stage: dense for stage, (dense, _) in split.items()})]
    if sharded.experts is not None:
        halves.append((sharded.experts, {stage: experts for stage, (_, experts) in split.items()}))
    return halves


def zero_layout(sharded: ShardedOptimizer,
                params_by_stage: Mapping[int, Sequence[nn.Parameter]],
                keys: Mapping[int, ParamKey]) -> list[ZeroRegion]:
    """The regions `ShardedOptimizer` builds from `params_by_stage`, checked against it (for
    an `ExpertShardedOptimizer`: its dense half's regions, then its experts')."""
    return [region for half, params in _halves(sharded, params_by_stage)
            for region in _half_layout(half, params, keys)]


def _half_layout(sharded: ShardedOptimizer,
                 params_by_stage: Mapping[int, Sequence[nn.Parameter]],
                 keys: Mapping[int, ParamKey]) -> list[ZeroRegion]:
    entries_by_stage, seen = {}, set()
    for stage in sorted(params_by_stage):  # the construction order of `ShardedOptimizer`
        entries, offset = [], 0
        for param in params_by_stage[stage]:
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                entries.append((keys[id(param)], param, offset))
                offset += param.numel()
        if entries:
            entries_by_stage[stage] = (tuple(entries), offset)
    layouts = sharded.layouts()
    problems = [] if sorted(layouts) == sorted(entries_by_stage) else [
        f"its regions are {sorted(layouts)}, the layout's {sorted(entries_by_stage)}"]
    regions = [ZeroRegion(entries, layouts[stage], sharded)
               for stage, (entries, _) in entries_by_stage.items() if stage in layouts]
    masters = [tuple(m.shape) for m in sharded.masters()]
    shapes = [(r.layout.num_buckets, r.layout.piece) for r in regions]
    problems += [] if masters == shapes else [
        f"its master shards have shapes {masters}, the layout {shapes}"]
    problems += [f"stage {stage} holds {numel} elements, its layout {layouts[stage].numel}"
                 for stage, (_, numel) in entries_by_stage.items()
                 if stage in layouts and layouts[stage].numel != numel]
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


def _overlaps(region: ZeroRegion) -> list[_Overlap]:
    """Where this rank's shard meets each parameter, one entry per bucket it meets."""
    return [(key, param, own, b, row) for key, param, offset in region.params
            for b, own, row in region.layout.overlaps(offset, param.numel(),
                                                      region.owner.dp_rank)]


def _with_masters(regions: Sequence[ZeroRegion]) -> list[tuple[ZeroRegion, torch.Tensor]]:
    """Each region with its owner's master shard (an owner's masters are in region order)."""
    owners = list({id(region.owner): region.owner for region in regions}.values())
    masters = {id(owner): iter(owner.masters()) for owner in owners}
    return [(region, next(masters[id(region.owner)])) for region in regions]


def _piece_tensors(regions: Sequence[ZeroRegion]) -> dict[tuple[int, int], nn.Parameter]:
    return {key: tensor for owner in {id(r.owner): r.owner for r in regions}.values()
            for key, tensor in owner.piece_tensors().items()}


def export_zero(sharded: ShardedOptimizer, regions: Sequence[ZeroRegion]) -> list[dict[str, Any]]:
    """This rank's pieces: per parameter and bucket its shard range, master values and state."""
    sharded.finish_param_gather()
    tensors = _piece_tensors(regions)
    pieces = []
    for region, master in _with_masters(regions):
        for key, param, own, b, row in _overlaps(region):
            tensor = tensors[(id(param), b)]
            state = sharded.optimizer.state.get(tensor, {})
            per_element = {n: v for n, v in state.items()
                           if isinstance(v, torch.Tensor) and v.shape == tensor.shape
                           and v.dim() > 0}
            whole = {n: v for n, v in state.items() if n not in per_element}
            pieces.append(make_piece(key, param.shape, own.start, own.stop, per_element,
                                     whole, master=master.detach()[b, row]))
    return pieces


def wanted_ranges(sharded: ShardedOptimizer, regions: Sequence[ZeroRegion]
                  ) -> dict[ParamKey, tuple[int, int]]:
    """Per parameter, the element range spanning what this rank's shard needs of it (its
    pieces in several buckets are cut from that range on import)."""
    spans: dict[ParamKey, tuple[int, int]] = {}
    for region in regions:
        for key, _, own, _, _ in _overlaps(region):
            lo, hi = spans.get(key, (own.start, own.stop))
            spans[key] = (min(lo, own.start), max(hi, own.stop))
    return spans


def import_zero(sharded: ShardedOptimizer, regions: Sequence[ZeroRegion],
                state: Mapping[ParamKey, Assembled], hyper: Sequence[Mapping[str, Any]], *,
                where: str) -> None:
    """Fill this rank's master shards and optimizer state from assembled pieces.

    Parameters must hold the checkpoint's weights already: a master range the pieces do not
    carry (a checkpoint from a plain optimizer) is taken from them in fp32.
    """
    sharded.finish_param_gather()
    tensors = _piece_tensors(regions)
    # torch's state_dict numbers the tensors of the inner optimizer's groups in order
    index_of = {id(p): i for i, p in enumerate(
        p for group in sharded.optimizer.param_groups for p in group["params"])}
    loaded: dict[int, dict[str, Any]] = {}
    for region, master in _with_masters(regions):
        for key, param, own, b, row in _overlaps(region):
            entry = state.get(key)
            mine = own if entry is None else slice(own.start - entry.start,
                                                   own.stop - entry.start)
            source = None if entry is None or entry.master is None else entry.master[mine]
            with torch.no_grad():
                master[b, row] = (param.detach().reshape(-1)[own] if source is None
                                  else source).to(master.dtype)
            index = index_of.get(id(tensors[(id(param), b)]))
            if entry is None or index is None:
                continue
            # each piece its own copy: torch keeps a loaded 'step' tensor as given, and a
            # tensor shared by pieces would count one step per piece
            loaded[index] = {**{name: flat[mine].clone() for name, flat in entry.sliced.items()},
                             **{name: value.clone() if isinstance(value, torch.Tensor) else value
                                for name, value in entry.whole.items()}}
    groups = sharded.optimizer.state_dict()["param_groups"]
    if hyper and len(hyper) == len(groups):
        groups = [{**saved, "params": group["params"]} for saved, group in zip(hyper, groups)]
    try:
        sharded.optimizer.load_state_dict({"state": loaded, "param_groups": groups})
    except (ValueError, KeyError, RuntimeError) as error:
        raise CheckpointError(f"{where}: the ZeRO inner optimizer refused the saved state "
                              f"({error}); build the same optimizer class as the saving job",
                              path=where) from error
