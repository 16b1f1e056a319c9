"""A manifest's numbers checked against the files it lists, before a loader sizes anything by them.

Why. An unsigned manifest is one checksum away from any edit, and a loader sizes lists and
loops by its numbers: a split ``size`` of 10^9 made a list of 10^9 slice coordinates per
parameter (a bare MemoryError after ~36 GB), a ``blocks`` list of 10^6 zeros a merge of 10^6
pieces per slice. So every number is tied to something the checkpoint must hold anyway:

- ``topology`` and ``world_size``: every rank of it wrote its ``rng_rank_NNNN.pt``, and no
  file names a rank outside it; layer files carry a ``-tp_NN`` slice under tp > 1 only, with
  NN < tp, and ``-ep_NN`` with NN < ep;
- a split: its ``size`` is the saved tp (axis 'tp') or ep (axis 'ep'), its ``layer`` is a
  layer of the checkpoint with a weights file, given once per (layer, name); its ``blocks``
  are >= 1 each and sum to at most the bytes of that layer's files (each element takes at
  least one byte), so their number is bounded by the data; ``dim`` < 64 (torch's limit).
The loader then checks the blocks against the tensors themselves (`pipeline.checkpoint.
reshard`). Pure Python, like `pipeline.checkpoint.manifest`.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.checkpoint.manifest_schema import Manifest

__all__ = ["MAX_DIMS", "bound_problems"]

MAX_DIMS = 64
"""torch's most dimensions of a tensor: a split's `dim` is below it."""

_LAYER_FILE = re.compile(r"layer_(\d+)(?:-tp_(\d+))?(?:-ep_(\d+))?-model_states\.pt")
_RNG_FILE = re.compile(r"rng_rank_(\d+)\.pt")


def bound_problems(manifest: Manifest) -> list[str]:
    """What in `manifest` disagrees with the files it lists (empty: nothing)."""
    return _topology_problems(manifest) + _split_problems(manifest)


def _topology_problems(manifest: Manifest) -> list[str]:
    problems = []
    _, dp, tp = manifest.topology
    shown = f"topology={list(manifest.topology)} (world_size {manifest.world_size})"
    rng_ranks = {int(matched.group(1)) for entry in manifest.files
                 if (matched := _RNG_FILE.fullmatch(entry.path))}
    if len(rng_ranks) != manifest.world_size or any(
            rank >= manifest.world_size for rank in rng_ranks):
        first = next(rank for rank in range(len(rng_ranks) + 1) if rank not in rng_ranks)
        said = (f"rank {first}'s rng_rank_{first:04d}.pt is not among them"
                if first < manifest.world_size else
                f"they hold generator files of {len(rng_ranks)} ranks")
        problems.append(f"{shown} does not match the files listed: {said} (every rank "
                        "writes one); the topology was edited")
    outside = sorted({entry.rank for entry in manifest.files
                      if entry.rank >= manifest.world_size})
    if outside:
        problems.append(f"files of rank {outside[0]} are listed, outside {shown}")
    if manifest.ep < 1 or (dp * manifest.cp) % manifest.ep:
        problems.append(f"ep={manifest.ep} does not divide dp={dp} × cp={manifest.cp} of "
                        f"{shown}")
    for entry in manifest.files:
        matched = _LAYER_FILE.fullmatch(entry.path)
        if matched is None or entry.role != "layer":
            continue
        index, tp_slice, ep_slice = (None if group is None else int(group)
                                     for group in matched.groups())
        if (tp_slice is None) != (tp == 1) or (tp_slice or 0) >= tp:
            problems.append(f"{entry.path} does not fit tp={tp} of {shown}; the topology "
                            "was edited")
        if (ep_slice or 0) >= manifest.ep:
            problems.append(f"{entry.path} does not fit ep={manifest.ep}")
        if index is not None and index >= manifest.num_layers:
            problems.append(f"{entry.path} is a layer past num_layers={manifest.num_layers}")
    return problems[:8]


def _split_problems(manifest: Manifest) -> list[str]:
    problems = []
    layer_bytes: Counter[int] = Counter()
    for entry in manifest.files:
        if entry.role == "layer":
            for layer in entry.layers:
                layer_bytes[layer] += entry.size
    sizes = {"tp": manifest.topology[2], "ep": manifest.ep}
    seen: set[tuple[int, str]] = set()
    for index, split in enumerate(manifest.splits):
        where = f"splits[{index}] (layer {split.layer} {split.name!r})"
        if (split.layer, split.name) in seen:
            problems.append(f"{where} is given twice")
        seen.add((split.layer, split.name))
        if split.layer >= manifest.num_layers or split.layer not in layer_bytes:
            problems.append(f"{where}: layer={split.layer} is not a layer with weights in "
                            f"this checkpoint (num_layers={manifest.num_layers})")
            continue
        if split.axis in sizes and split.size != sizes[split.axis]:
            problems.append(f"{where}: size={split.size} is not the saved "
                            f"{split.axis}={sizes[split.axis]}")
        if split.dim >= MAX_DIMS:
            problems.append(f"{where}: dim={split.dim} is not below {MAX_DIMS}")
        if 0 in split.blocks:
            problems.append(f"{where}: blocks holds a 0 (every block has elements)")
        elif sum(split.blocks) > layer_bytes[split.layer]:
            problems.append(f"{where}: blocks sum to {sum(split.blocks):,} elements, more "
                            f"than the {layer_bytes[split.layer]:,} bytes of the layer's files")
    return problems[:8]
