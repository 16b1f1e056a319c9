"""Optimizer state in a partition-independent form: per parameter, keyed by (layer, name).

torch's `optimizer.state_dict()` numbers parameters by their position in this rank's
optimizer, which changes with the partition. A checkpoint instead stores *pieces*: for one
parameter (global layer index, name inside the layer) and a range [start, stop) of its
flattened elements, the per-element state (``exp_avg`` ...) as flat tensors and the rest
(``step``) whole. A plain optimizer saves each parameter as one piece [0, numel); a ZeRO-1
rank saves the ranges its shard covers (`pipeline.checkpoint.zero_state`). Loading assembles, for
every parameter this rank now holds, the range it needs from whichever pieces cover it, so
any partition and any data-parallel size can read any checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pipeline.errors import CheckpointError

__all__ = ["Assembled", "ParamKey", "assemble", "export_torch_optimizer", "hyperparameters",
           "import_torch_optimizer", "make_piece", "param_keys"]

ParamKey = tuple[int, str]
"""(global layer index, parameter name inside the layer): the same under any partition."""


def param_keys(named: Iterable[tuple[ParamKey, nn.Parameter]]) -> dict[int, ParamKey]:
    """id(parameter) -> its key, from `PipelineModule.named_layer_parameters()`."""
    return {id(param): key for key, param in named}


def make_piece(key: ParamKey, shape: Sequence[int], start: int, stop: int,
               sliced: Mapping[str, torch.Tensor], whole: Mapping[str, Any],
               master: torch.Tensor | None = None) -> dict[str, Any]:
    """One saved piece (plain types only, so `torch.load(weights_only=True)` reads it)."""
    return {"layer": key[0], "name": key[1], "shape": list(shape), "start": start,
            "stop": stop, "sliced": {n: t.detach().reshape(-1).cpu().clone()
                                     for n, t in sliced.items()},
            "whole": {n: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
                      for n, v in whole.items()},
            "master": None if master is None else master.detach().reshape(-1).cpu().clone()}


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's settings (lr, betas, ...) without its parameters."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def export_torch_optimizer(optimizer: torch.optim.Optimizer,
                           keys: Mapping[int, ParamKey]) -> list[dict[str, Any]]:
    """A piece per parameter of a torch optimizer: state of the same shape as the parameter
    is per-element, anything else (``step``) is kept whole."""
    pieces = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            key = keys.get(id(param))
            if key is None:
                raise CheckpointError("the optimizer holds a parameter that is not in the "
                                      "PipelineModule's layers; build the optimizer from the "
                                      "engine's parameters", path="<optimizer>")
            state = optimizer.state.get(param, {})
            sliced = {n: v for n, v in state.items()
                      if isinstance(v, torch.Tensor) and v.shape == param.shape and v.dim() > 0}
            whole = {n: v for n, v in state.items() if n not in sliced}
            pieces.append(make_piece(key, param.shape, 0, param.numel(), sliced, whole))
    return pieces


@dataclass
class Assembled:
    """One parameter's state over a range [start, stop) of its flattened elements."""

    shape: tuple[int, ...]
    start: int
    stop: int
    sliced: dict[str, torch.Tensor] = field(default_factory=dict)
    whole: dict[str, Any] = field(default_factory=dict)
    master: torch.Tensor | None = None
    covered: dict[str, int] = field(default_factory=dict)
    """Elements of [start, stop) filled so far per state name ('' for the master)."""


def assemble(pieces: Iterable[Mapping[str, Any]], wanted: Mapping[ParamKey, tuple[int, int]],
             *, where: str) -> dict[ParamKey, Assembled]:
    """For each wanted key and range, the state gathered from every piece that overlaps it.

    Keys without any piece are left out (the optimizer had no state for them). A range that
    pieces cover only in part is refused: a shard file of the checkpoint is missing.
    """
    result: dict[ParamKey, Assembled] = {}
    for piece in pieces:
        key = (int(piece["layer"]), str(piece["name"]))
        if key not in wanted:
            continue
        start, stop = wanted[key]
        entry = result.setdefault(key, Assembled(tuple(piece["shape"]), start, stop))
        if tuple(piece["shape"]) != entry.shape:
            raise CheckpointError(f"{where}: layer {key[0]} parameter {key[1]!r} was saved "
                                  f"with shapes {entry.shape} and {tuple(piece['shape'])}",
                                  path=where)
        lo, hi = max(start, int(piece["start"])), min(stop, int(piece["stop"]))
        if lo >= hi:
            continue
        source = slice(lo - int(piece["start"]), hi - int(piece["start"]))
        target = slice(lo - start, hi - start)
        for name, values in piece["sliced"].items():
            flat = entry.sliced.setdefault(name, torch.zeros(stop - start, dtype=values.dtype))
            flat[target] = values[source]
            entry.covered[name] = entry.covered.get(name, 0) + hi - lo
        if piece["master"] is not None:
            if entry.master is None:
                entry.master = torch.zeros(stop - start, dtype=piece["master"].dtype)
            entry.master[target] = piece["master"][source]
            entry.covered[""] = entry.covered.get("", 0) + hi - lo
        for name, value in piece["whole"].items():
            entry.whole.setdefault(name, value)
    for key, entry in result.items():
        partial = {name or "master": count for name, count in entry.covered.items()
                   if count != entry.stop - entry.start}
        if partial:
            raise CheckpointError(
                f"{where}: the optimizer state of layer {key[0]} parameter {key[1]!r} covers "
                f"only {partial} of its {entry.stop - entry.start} elements [{entry.start}, "
                f"{entry.stop}); a shard file is missing from the checkpoint", path=where)
    return result


def import_torch_optimizer(optimizer: torch.optim.Optimizer, keys: Mapping[int, ParamKey],
                           state: Mapping[ParamKey, Assembled],
                           hyper: Sequence[Mapping[str, Any]], *, where: str) -> None:
    """Load assembled full-range state into a torch optimizer over this rank's parameters."""
    current = optimizer.state_dict()
    loaded: dict[int, dict[str, Any]] = {}
    index = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            key = keys[id(param)]
            entry = state.get(key)
            if entry is not None:
                if entry.shape != tuple(param.shape):
                    raise CheckpointError(
                        f"{where}: layer {key[0]} parameter {key[1]!r} has shape "
                        f"{tuple(param.shape)} here but {entry.shape} in the checkpoint; "
                        "load it into the same model", path=where)
                loaded[index] = {**{n: t.reshape(param.shape) for n, t in entry.sliced.items()},
                                 **entry.whole}
            index += 1
    groups = current["param_groups"]
    if hyper and len(hyper) == len(groups):
        groups = [{**saved, "params": group["params"]} for saved, group in zip(hyper, groups)]
    try:
        optimizer.load_state_dict({"state": loaded, "param_groups": groups})
    except (ValueError, KeyError, RuntimeError) as error:
        raise CheckpointError(f"{where}: the optimizer refused the saved state ({error}); "
                              "build the same optimizer class as the saving job",
                              path=where) from error
