"""Read a rank's HF tensors from a safetensors checkpoint directory or a state dict: only the
named tensors, only a tensor-parallel slice's rows, only an expert-parallel rank's experts."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch

from pipeline.errors import PipelineConfigError
from pipeline.interop.hf_moe_checkpoint import MoEKeyMap
from pipeline.parallel.tensor.shard_layout import ShardLayout

__all__ = ["ExpertRows", "Piece", "TensorSource", "Want", "read_pieces", "read_wanted",
           "tensor_source"]


@dataclasses.dataclass(frozen=True, slots=True)
class ExpertRows:
    """Experts [first, stop) of a layer of `total` (an expert-parallel shard, or all)."""

    first: int
    stop: int
    total: int


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
    """One tensor of the source, or part of it."""

    key: str
    """Its name in the source."""
    layout: ShardLayout | None = None
    """A tensor-parallel slice: read only its rows (or columns)."""
    rows: ExpertRows | None = None
    """Read only rows [first, stop) of dim 0, whose length must be `total`."""


@dataclasses.dataclass(frozen=True, slots=True)
class Want:
    """What a rank needs of one in-memory (``hf_model.state_dict()``) name."""

    layout: ShardLayout | None
    """Its tensor-parallel slice, if any."""
    experts: ExpertRows | None
    """For a fused expert tensor: which experts of how many."""


class TensorSource:
    """A safetensors checkpoint directory (read lazily, per key) or a state dict."""

    def __init__(self, where: str, names: Collection[str], files: Mapping[str, str] | None,
                 state: Mapping[str, torch.Tensor] | None) -> None:
        self.where = where
        self.names = frozenset(names)
        self._files = files
        self._state = state

    def read(self, pieces: list[Piece]) -> dict[Piece, torch.Tensor]:
        """Every piece, each file opened once; a wrong expert count is one error for all."""
        problems: list[str] = []
        out: dict[Piece, torch.Tensor] = {}
        if self._state is not None:
            for piece in pieces:
                out[piece] = _cut(self._state[piece.key], piece, problems)
        else:
            from safetensors import safe_open

            assert self._files is not None
            by_file: dict[str, list[Piece]] = {}
            for piece in pieces:
                by_file.setdefault(self._files[piece.key], []).append(piece)
            for name, wanted in by_file.items():
                with safe_open(str(Path(self.where) / name), framework="pt") as handle:
                    present = set(handle.keys())
                    absent = [piece.key for piece in wanted if piece.key not in present]
                    if absent:
                        raise PipelineConfigError(
                            f"{self.where}: {name} lacks {sorted(absent)} that its index "
                            "lists; write the checkpoint again with save_pretrained")
                    for piece in wanted:
                        out[piece] = _read(handle, piece, problems)
        if problems:
            raise PipelineConfigError("HF weights do not fit: " + "; ".join(problems)
                                      + "; build the layers from the checkpoint's own config")
        return out


def tensor_source(source: str | Path | Mapping[str, torch.Tensor]) -> TensorSource:
    """A directory ``save_pretrained`` wrote (``model.safetensors`` or a sharded index: only
    headers are read here), or a state dict."""
    if isinstance(source, Mapping):
        return TensorSource("the state dict", source.keys(), None, source)
    root = Path(source)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        files: dict[str, str] = json.loads(index.read_text())["weight_map"]
    elif (root / "model.safetensors").is_file():
        from safetensors import safe_open

        with safe_open(str(root / "model.safetensors"), framework="pt") as handle:
            files = dict.fromkeys(handle.keys(), "model.safetensors")
    else:
        raise PipelineConfigError(
            f"{root} holds no model.safetensors nor model.safetensors.index.json; save the "
            "model with save_pretrained(directory) (safetensors is its default format)")
    return TensorSource(str(root), files.keys(), files, None)


def _window(piece: Piece, shape: list[int], problems: list[str]) -> tuple[slice, ...] | None:
    """The index of `piece.rows` in a tensor of `shape` (None: read it whole)."""
    rows = piece.rows
    if rows is None:
        return None
    if not shape or shape[0] != rows.total:
        problems.append(f"{piece.key}: shape {tuple(shape)} in the checkpoint, "
                        f"{rows.total} experts in the config")
        return None
    return (slice(rows.first, rows.stop),)


def _cut(value: torch.Tensor, piece: Piece, problems: list[str]) -> torch.Tensor:
    window = _window(piece, list(value.shape), problems)
    if window is not None:
        value = value[window]
    return value if piece.layout is None else piece.layout.shard(value)


def _read(handle: Any, piece: Piece, problems: list[str]) -> torch.Tensor:
    """The whole tensor, only its expert rows, or only its layout's pieces (each a slice
    along the layout's dim), through safetensors' lazy ``get_slice``."""
    if piece.layout is None and piece.rows is None:
        return handle.get_tensor(piece.key)
    lazy = handle.get_slice(piece.key)
    shape = list(lazy.get_shape())
    window = _window(piece, shape, problems)
    if piece.layout is None:
        return lazy[window] if window is not None else lazy[:]
    if window is not None:
        raise PipelineConfigError(f"{piece.key}: an expert-parallel shard with a "
                                  "tensor-parallel slice is not read; use one of them")
    layout = piece.layout
    pieces = [lazy[tuple([slice(None)] * layout.dim + [slice(lo, hi)]
                         + [slice(None)] * (len(shape) - layout.dim - 1))]
              for lo, hi in layout.ranges()]
    return torch.cat(pieces, dim=layout.dim)


def _listed(names: list[str]) -> str:
    shown = sorted(names)[:8]
    return str(shown) + (f" and {len(names) - len(shown)} more" if len(names) > len(shown) else "")


def _missing(source: TensorSource, names: list[str]) -> None:
    absent = sorted({name for name in names if name not in source.names})
    if absent:
        raise PipelineConfigError(f"{source.where} lacks {_listed(absent)}; is it a checkpoint "
                                  "of the same model type and size as the config?")


def read_pieces(source: TensorSource, keys: list[str],
                layouts: Mapping[str, ShardLayout]) -> dict[str, torch.Tensor]:
    """Tensors under their names in the source (a key in `layouts`: only its slice)."""
    _missing(source, keys)
    pieces = {key: Piece(key, layouts.get(key)) for key in keys}
    read = source.read(list(pieces.values()))
    return {key: read[piece] for key, piece in pieces.items()}


_Plan = Piece | list[list[Piece]]
"""One piece, or a fused expert tensor's pieces: per expert, per source."""


def _plan(source: TensorSource, key: str, want: Want, key_map: MoEKeyMap | None) -> _Plan:
    if key_map is None or key in source.names:
        return Piece(key, want.layout, want.experts)
    if key_map.fusion(key) is None:
        return Piece(key_map.checkpoint_name(key), want.layout, want.experts)
    experts = want.experts
    if want.layout is not None or experts is None:
        raise PipelineConfigError(f"{key}: a fused expert tensor is read by expert rows only "
                                  "(tensor parallelism of experts is not supported)")
    extra = key_map.expert_names(key, experts.total)[0]
    if extra in source.names:
        raise PipelineConfigError(f"HF weights do not fit: {source.where} holds {extra}, more "
                                  f"than the config's {experts.total} experts; build the "
                                  "layers from the checkpoint's own config")
    return [[Piece(name) for name in key_map.expert_names(key, expert)]
            for expert in range(experts.first, experts.stop)]


def _pieces(plan: _Plan) -> list[Piece]:
    return [plan] if isinstance(plan, Piece) else [piece for row in plan for piece in row]


def read_wanted(source: TensorSource, wants: Mapping[str, Want],
                key_map: MoEKeyMap | None) -> dict[str, torch.Tensor]:
    """In-memory names' tensors (only the wanted slice or experts of each), read under the
    in-memory name if the source has it (a state dict; an export of an older pipesched),
    else under the checkpoint names transformers writes (`MoEKeyMap`): a fused expert tensor
    from one tensor per expert, only the wanted experts'."""
    plans = {key: _plan(source, key, want, key_map) for key, want in wants.items()}
    _missing(source, [piece.key for plan in plans.values() for piece in _pieces(plan)])
    read = source.read([piece for plan in plans.values() for piece in _pieces(plan)])
    out: dict[str, torch.Tensor] = {}
    for key, plan in plans.items():
        if isinstance(plan, Piece):
            out[key] = read[plan]
        else:
            assert key_map is not None  # only a key map makes a fused plan
            out[key] = key_map.join(key, [[read[piece] for piece in row] for row in plan])
    return out
