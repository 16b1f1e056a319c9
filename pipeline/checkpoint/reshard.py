"""Re-cut tensor- and expert-parallel slices saved under one (tp, ep) for another (pp, tp, dp).

The saved form is per slice, as the ranks hold it: tp rank t writes ``layer_03-tp_0t``, ep
rank e > 0 writes its experts to ``layer_03-ep_0e`` (ep rank 0's are in the layer file), and
optimizer pieces are cut from each rank's own slice; the manifest records how every split
parameter was cut (`SavedSplit`: axis, dim, the fused blocks, size). Why per slice and not
merged full tensors: a save stays local (no rank gathers a layer it does not hold, no extra
collective), a load under the same layout copies back exactly the slice a rank wrote, and
checkpoints written before resharding keep their meaning. A load under another tp or ep
merges the saved slices into the full tensor with the saved layout (`ShardLayout.merge`:
each fused block, e.g. GPT-2's Q|K|V, joined separately; experts in order) and cuts this
rank's part with its own layout. A parameter whole on every saving rank (a norm, key/value
heads replicated because tp exceeds them) is read from tp slice 0. Optimizer state
(Adam's moments, ZeRO's fp32 master) is re-cut exactly like its parameter; scalars such as
``step`` are taken from slice 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeline.checkpoint.manifest import Manifest, SavedSplit
from pipeline.checkpoint.optimizer_state import Assembled, ParamKey, assemble
from pipeline.errors import CheckpointError
from pipeline.parallel.param_marks import expert_shard
from pipeline.parallel.tensor.shard_layout import ShardLayout, layout_of

__all__ = ["Cut", "SavedGrid", "Slice", "assemble_resharded", "cut_of", "module_splits",
           "reshard_layer"]


@dataclass(frozen=True)
class Cut:
    """How a parameter is split: `layout` along the grid's `axis` ('tp' or 'ep')."""

    axis: str
    layout: ShardLayout

    def same_cut(self, split: SavedSplit) -> bool:
        """Whether `split` cut the parameter exactly as this one (then slice i is rank i's)."""
        return (self.axis, self.layout.dim, self.layout.blocks, self.layout.size) == (
            split.axis, split.dim, split.blocks, split.size)


def cut_of(param: torch.Tensor) -> Cut | None:
    """This rank's cut of `param` (None: every tp and ep rank holds it whole)."""
    layout, shard = layout_of(param), expert_shard(param)
    if layout is not None and shard is not None:
        raise CheckpointError("a parameter split over both tp and ep cannot be checkpointed",
                              path="<module>")
    if layout is not None:
        return Cut("tp", layout)
    if shard is not None:
        first, total = shard
        local = param.shape[0]
        return Cut("ep", ShardLayout(0, (total,), first // local, total // local))
    return None


def module_splits(named: Iterable[tuple[ParamKey, nn.Parameter]]) -> list[SavedSplit]:
    """The `SavedSplit` of every split parameter of this rank (for the manifest)."""
    splits = []
    for (layer, name), param in named:
        cut = cut_of(param)
        if cut is not None:
            layout = cut.layout
            splits.append(SavedSplit(layer, name, cut.axis, layout.dim, layout.blocks,
                                     layout.size))
    return splits


Slice = tuple[int, int]
"""(tp rank, ep rank) of the saving job whose slice a file or piece holds."""


@dataclass(frozen=True)
class SavedGrid:
    """The saving job's splits, and which of its slices this rank reads of a whole tensor."""

    splits: Mapping[ParamKey, SavedSplit]
    base_tp: int
    """tp slice to read a parameter whole on every tp rank from: this rank's own under the
    same tp (the same bytes it wrote), else 0."""
    recorded: bool = True
    """False for a checkpoint saved at tp > 1 before splits were recorded: each rank reads
    its own tp slice as it is (the loader refuses it under another tp)."""

    @classmethod
    def of(cls, manifest: Manifest, tp: int, tp_rank: int) -> SavedGrid:
        return cls({(s.layer, s.name): s for s in manifest.splits},
                   tp_rank if manifest.topology[2] == tp else 0,
                   bool(manifest.splits) or manifest.topology[2] == 1)

    def same_tp_cuts(self, cuts: Mapping[ParamKey, Cut | None]) -> bool:
        """Whether every parameter of `cuts` is cut over tp here exactly as it was saved
        (then a rank's own tp slice is all it reads)."""
        for key, cut in cuts.items():
            split = self.splits.get(key)
            saved = split is not None and split.axis == "tp"
            here = cut is not None and cut.axis == "tp"
            if saved != here or (split is not None and here and cut is not None
                                 and not cut.same_cut(split)):
                return False
        return True

    def slices(self, key: ParamKey, cut: Cut | None
               ) -> tuple[SavedSplit | None, list[Slice], bool]:
        """The saved split of `key`, the slices to read, and whether this rank's part is
        exactly the one slice read (no merge, no cut): its own when the cut is the same,
        else every saved slice (to merge)."""
        split = self.splits.get(key)
        if split is None:
            return None, [(self.base_tp, 0)], cut is None or not self.recorded
        if cut is not None and cut.same_cut(split):
            coordinates, direct = [cut.layout.rank], True
        else:
            coordinates, direct = list(range(split.size)), False
        return split, [(c, 0) if split.axis == "tp" else (self.base_tp, c)
                       for c in coordinates], direct


def _recut(split: SavedSplit | None, parts: Sequence[torch.Tensor], cut: Cut | None,
           what: str, where: str) -> torch.Tensor:
    """This rank's part of the tensor whose saved slices are `parts` (in slice order)."""
    if split is not None:
        _check_blocks(split, parts, what, where)
    try:
        full = parts[0] if split is None else \
            ShardLayout(split.dim, split.blocks, 0, split.size).merge(list(parts))
        return full if cut is None else cut.layout.shard(full)
    except (ValueError, RuntimeError, IndexError) as error:
        raise CheckpointError(f"{where}: {what} cannot be re-cut for this job ({error}); "
                              "load it into the same model", path=where) from None


def _check_blocks(split: SavedSplit, parts: Sequence[torch.Tensor], what: str,
                  where: str) -> None:
    """The recorded cut fits the saved slices themselves, before a merge loops over its
    blocks (the manifest bounds them only by file sizes: `manifest_bounds`)."""
    extent = sum(int(part.shape[split.dim]) for part in parts
                 if split.dim < part.dim())
    if len(parts) != split.size or any(split.dim >= part.dim() for part in parts) \
            or sum(split.blocks) != extent:
        raise CheckpointError(
            f"{where}: the manifest's split of {what} (dim={split.dim}, {len(split.blocks)} "
            f"blocks summing to {sum(split.blocks)}, size={split.size}) does not fit its "
            f"{len(parts)} saved slices ({extent} along that dim); the manifest was edited",
            path=where)


def reshard_layer(index: int, expected: Mapping[str, torch.Tensor],
                  cuts: Mapping[str, Cut | None], grid: SavedGrid,
                  read: Callable[[Slice], Mapping[str, torch.Tensor]], *, where: str
                  ) -> dict[str, torch.Tensor]:
    """Layer `index`'s state for this rank: each entry from the saved slices it needs
    (`read(slice)` returns that slice's file of the layer; an ep slice's file holds only
    the experts)."""
    state = {}
    for name in expected:
        cut = cuts.get(name)
        split, slices, direct = grid.slices((index, name), cut)
        parts = []
        for slice_ in slices:
            saved = read(slice_)
            if name not in saved:
                raise CheckpointError(f"{where}: layer {index} {name!r} is not in the saved "
                                      f"slice (tp, ep) = {slice_}; load it into the same "
                                      "model", path=where)
            parts.append(saved[name])
        state[name] = parts[0] if direct \
            else _recut(split, parts, cut, f"layer {index} {name!r}", where)
    return state


def _whole_slice(pieces: Sequence[Mapping[str, Any]], key: ParamKey, where: str
                 ) -> Assembled | None:
    """One saved slice's state over all its elements (None: the slice has no state)."""
    if not pieces:
        return None
    numel = 1
    for extent in pieces[0]["shape"]:
        numel *= int(extent)
    return assemble(pieces, {key: (0, numel)}, where=where).get(key)


def assemble_resharded(pieces: Iterable[tuple[Slice, Mapping[str, Any]]],
                       wanted: Mapping[ParamKey, tuple[int, int]],
                       cuts: Mapping[ParamKey, Cut | None],
                       shapes: Mapping[ParamKey, tuple[int, ...]], grid: SavedGrid, *,
                       where: str) -> dict[ParamKey, Assembled]:
    """Like `assemble`, for this rank's cut of each parameter: pieces tagged with the saved
    slice they were cut from, merged and re-cut where the layouts differ."""
    by_key: dict[ParamKey, dict[Slice, list[Mapping[str, Any]]]] = {}
    for (tp_slice, ep_slice), piece in pieces:
        key = (int(piece["layer"]), str(piece["name"]))
        if key in wanted:
            # only experts differ between ep ranks: a dense parameter's ZeRO pieces come
            # from every dp rank, whatever its ep rank
            split = grid.splits.get(key)
            slice_ = (tp_slice, ep_slice if split is not None and split.axis == "ep" else 0)
            by_key.setdefault(key, {}).setdefault(slice_, []).append(piece)
    result: dict[ParamKey, Assembled] = {}
    for key, (start, stop) in wanted.items():
        split, slices, direct = grid.slices(key, cuts.get(key))
        found = by_key.get(key, {})
        if direct:
            result.update(assemble(found.get(slices[0], []), {key: (start, stop)},
                                   where=where))
            continue
        parts = [_whole_slice(found.get(s, []), key, where) for s in slices]
        if all(part is None for part in parts):
            continue  # the saving optimizer had no state for it
        if any(part is None for part in parts):
            raise CheckpointError(f"{where}: the optimizer state of layer {key[0]} "
                                  f"{key[1]!r} is missing for some saved slices; a file is "
                                  "missing from the checkpoint", path=where)
        result[key] = _recut_state(key, split, [p for p in parts if p is not None],
                                   cuts.get(key), shapes[key], (start, stop), where)
    return result


def _recut_state(key: ParamKey, split: SavedSplit | None, parts: list[Assembled],
                 cut: Cut | None, shape: tuple[int, ...], span: tuple[int, int],
                 where: str) -> Assembled:
    """The state over `span` of this rank's cut, from every saved slice's whole state."""
    start, stop = span
    what = f"the optimizer state of layer {key[0]} {key[1]!r}"
    names = set(parts[0].sliced)
    if any(set(part.sliced) != names for part in parts):
        raise CheckpointError(f"{where}: {what} holds different entries in different saved "
                              "slices; it was not written by this pipesched", path=where)

    def recut(flats: list[torch.Tensor]) -> torch.Tensor:
        shaped = [flat.reshape(part.shape) for flat, part in zip(flats, parts)]
        mine = _recut(split, shaped, cut, what, where)
        if tuple(mine.shape) != shape:
            raise CheckpointError(f"{where}: {what} re-cuts to {tuple(mine.shape)}, the "
                                  f"parameter here is {shape}; load it into the same model",
                                  path=where)
        return mine.reshape(-1)[start:stop].clone()

    entry = Assembled(shape, start, stop, whole=dict(parts[0].whole))
    entry.sliced = {name: recut([part.sliced[name] for part in parts]) for name in names}
    masters = [part.master for part in parts]
    if all(master is not None for master in masters):
        entry.master = recut([master for master in masters if master is not None])
    return entry
