"""Load a checkpoint into this rank's part of any (pp, tp, dp, ep): verify everything, then apply.

Under another tp or ep the saved slices are merged and re-cut (`pipeline.checkpoint.reshard`).

Two phases, each ending in a vote of all ranks (`agree`): first every rank resolves the
directory, checks the manifest and that every listed file is present with its size, reads
the files it needs and checks their sha256, shapes, optimizer hyperparameters, loss
scaler fields and generator states (set into scratch generators) — changing nothing. Only if every
rank succeeded does any rank copy weights, optimizer state, scaler and generators in.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.checkpoint.atomic_files import sha256_bytes
from pipeline.checkpoint.manifest import (
    FileEntry,
    Manifest,
    read_manifest,
    resolve_checkpoint,
    verify_files,
)
from pipeline.checkpoint.optimizer_state import (
    Assembled,
    ParamKey,
    import_torch_optimizer,
    param_keys,
)
from pipeline.checkpoint.reshard import SavedGrid, Slice, assemble_resharded, cut_of, reshard_layer
from pipeline.checkpoint.rng_state import check_rng, restore_rng
from pipeline.checkpoint.save import (
    CheckpointInfo,
    CheckpointParts,
    agree,
    layer_file,
    rng_file,
)
from pipeline.checkpoint.zero_state import ZeroRegion, import_zero, wanted_ranges, zero_layout
from pipeline.errors import CheckpointError
from pipeline.files import UnreadableInputError, read_regular_file
from pipeline.parallel.topology import Topology
from pipeline.parallel.zero import ShardedOptimizer

__all__ = ["load_checkpoint"]


@dataclass
class _Prepared:
    """Everything read and checked, nothing applied yet."""

    step_dir: str
    manifest: Manifest
    weights: dict[int, dict[str, torch.Tensor]]
    optimizer_state: dict[ParamKey, Assembled] | None
    hyper: list[dict[str, Any]]
    regions: list[ZeroRegion] | None
    rng: dict[str, Any] | None


def load_checkpoint(path: str, parts: CheckpointParts, *,
                    load_optimizer: bool = True) -> CheckpointInfo:
    """Load `path` (a checkpoint root, following `latest`, or a step directory) into this
    rank's layers, optimizer, loss scaler and generators (a collective). Refuses a missing,
    torn, corrupt or mismatched checkpoint with `CheckpointError` before changing anything.
    The caller takes the step counter from the returned info."""
    path = os.fspath(path)
    if isinstance(parts.optimizer, ShardedOptimizer):
        parts.optimizer.finish_param_gather()  # a gather in flight would overwrite the load
    prepared: _Prepared | None = None
    problem: CheckpointError | None = None
    try:
        prepared = _prepare(path, parts, load_optimizer)
    except CheckpointError as error:
        problem = error
    agree(problem, "loading the checkpoint")
    assert prepared is not None  # agree raised otherwise
    try:
        _apply(prepared, parts)
    except (CheckpointError, RuntimeError, ValueError, KeyError) as error:
        problem = CheckpointError(f"{type(error).__name__}: {error}; the state is now partly "
                                  "loaded: load the checkpoint again", path=prepared.step_dir)
    agree(problem, "applying the checkpoint")
    return CheckpointInfo(prepared.step_dir, prepared.manifest.step,
                          rng_restored=prepared.rng is not None)


def _read(step_dir: str, entry: FileEntry) -> Any:
    """A file's contents after checking its size and sha256 against the manifest."""
    path = os.path.join(step_dir, entry.path)
    try:  # a regular file of at most the recorded size: never a FIFO's wait, /dev/zero's flood
        data = read_regular_file(path, entry.size)
    except UnreadableInputError as error:
        raise CheckpointError(f"{error}; load an earlier step directory", path=path) from None
    except OSError as error:
        raise CheckpointError(f"cannot read {path}: {error.strerror}", path=path) from None
    if len(data) != entry.size or sha256_bytes(data) != entry.sha256:
        raise CheckpointError(f"{path} fails its sha256 check ({len(data)} bytes, manifest "
                              f"says {entry.size}): the file is corrupt; load an earlier step "
                              "directory", path=path)
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:  # torch.load raises many types; all mean the same here
        raise CheckpointError(f"{path} passes its checksum but torch cannot read it "
                              f"({type(error).__name__}: {error})", path=path) from None


def _prepare(path: str, parts: CheckpointParts, load_optimizer: bool) -> _Prepared:
    step_dir = resolve_checkpoint(path)
    manifest = read_manifest(step_dir)
    _check_fits(manifest, parts, step_dir, load_optimizer)
    verify_files(step_dir, manifest.files, checksums=False)  # a file lost anywhere: refuse
    try:
        weights = _read_weights(step_dir, manifest, parts)
        state: dict[ParamKey, Assembled] | None = None
        hyper: list[dict[str, Any]] = []
        regions: list[ZeroRegion] | None = None
        if load_optimizer and parts.optimizer_kind != "none" and manifest.optimizer != "none":
            state, hyper, regions = _read_optimizer(step_dir, manifest, parts)
        rng = None
        topology = parts.topology
        if manifest.topology == (topology.pp, topology.dp, topology.tp) \
                and manifest.ep == topology.ep and manifest.cp == topology.cp:
            entry = next((e for e in manifest.files if e.path == rng_file(parts.rank)), None)
            rng = None if entry is None else check_rng(
                _read(step_dir, entry), where=os.path.join(step_dir, entry.path))
        _check_scaler(manifest, parts, step_dir)
    except (KeyError, TypeError, IndexError, AttributeError, ValueError) as error:
        if isinstance(error, CheckpointError):
            raise
        raise CheckpointError(f"{step_dir}: a file passes its checksum but is not laid out as "
                              f"pipesched writes it ({type(error).__name__}: {error})",
                              path=step_dir) from error
    return _Prepared(step_dir, manifest, weights, state, hyper, regions, rng)


def _check_fits(manifest: Manifest, parts: CheckpointParts, step_dir: str,
                load_optimizer: bool) -> None:
    module, topology = parts.module, parts.topology
    problems = []
    if manifest.num_layers != module.num_layers:
        problems.append(f"it holds {manifest.num_layers} layers, the module has "
                        f"{module.num_layers}: load it into the same layer list")
    saved_tp = manifest.topology[2]
    if saved_tp != topology.tp and saved_tp > 1 and not manifest.splits:
        problems.append(f"it was saved with tensor-parallel size {saved_tp} by a pipesched "
                        "that did not record how parameters were split, this job has "
                        f"{topology.tp}: load it with tp={saved_tp} (then save again to "
                        "re-shard)")
    if (load_optimizer and manifest.optimizer != "none" and parts.optimizer_kind != "none"
            and manifest.optimizer_class != parts.optimizer_class):
        problems.append(f"its optimizer is {manifest.optimizer_class}, this job's "
                        f"{parts.optimizer_class}: build the same optimizer, or pass "
                        "load_optimizer=False to start the optimizer afresh")
    if problems:
        raise CheckpointError(f"{step_dir} does not fit this job: " + "; ".join(problems),
                              path=step_dir)


def _check_scaler(manifest: Manifest, parts: CheckpointParts, step_dir: str) -> None:
    """The saved loss scaler state has the fields this job's scaler takes."""
    if manifest.loss_scaler is None or parts.loss_scaler is None:
        return
    expected = sorted(parts.loss_scaler.state_dict())
    if sorted(manifest.loss_scaler) != expected:
        saved = sorted(manifest.loss_scaler)
        raise CheckpointError(f"{step_dir}: its loss scaler state has {saved}, this job's "
                              f"scaler takes {expected}; load it with the same precision "
                              "settings", path=step_dir)


def _slice_reader(step_dir: str, manifest: Manifest, index: int
                  ) -> Callable[[Slice], dict[str, torch.Tensor]]:
    """Reads (once each) the saved files of layer `index` by (tp, ep) slice."""
    by_name = {entry.path: entry for entry in manifest.files}
    files: dict[Slice, dict[str, torch.Tensor]] = {}

    def read(slice_: Slice) -> dict[str, torch.Tensor]:
        if slice_ not in files:
            tp_rank, ep_rank = slice_
            name = layer_file(index, tp_rank if manifest.topology[2] > 1 else None, ep_rank)
            if name not in by_name:
                raise CheckpointError(f"{step_dir} has no weights of layer {index} ({name}); "
                                      "was it saved from the same layer list?",
                                      path=os.path.join(step_dir, name))
            files[slice_] = _read(step_dir, by_name[name])
        return files[slice_]

    return read


def _read_weights(step_dir: str, manifest: Manifest, parts: CheckpointParts
                  ) -> dict[int, dict[str, torch.Tensor]]:
    grid = SavedGrid.of(manifest, parts.topology.tp,
                        parts.topology.position(parts.rank).tp_rank)
    layers = parts.layers
    for split in manifest.splits:  # a record no parameter reads would pass unnoticed
        held = layers.get(split.layer)
        names = [] if held is None else [name for name, _ in held.named_parameters()]
        if held is not None and split.name not in names:
            raise CheckpointError(
                f"{step_dir}: the manifest's split of layer {split.layer} names "
                f"{split.name!r}, which is not a parameter of that layer ({names[:4]}); the "
                "manifest was edited, or load it into the same model", path=step_dir)
    weights = {}
    for index, layer in sorted(parts.layers.items()):
        expected = layer.state_dict()
        if not expected:
            continue
        read = _slice_reader(step_dir, manifest, index)
        path = os.path.join(step_dir, layer_file(
            index, grid.base_tp if manifest.topology[2] > 1 else None))
        cuts = {name: cut_of(param) for name, param in layer.named_parameters()}
        saved = set(read((grid.base_tp, 0)))  # the layer's own file names every entry saved
        mismatched = sorted(saved ^ set(expected))
        state = {} if mismatched else reshard_layer(index, expected, cuts, grid, read,
                                                    where=path)
        mismatched += [f"{n}: saved {tuple(v.shape)}, here {tuple(expected[n].shape)}"
                       for n, v in state.items() if v.shape != expected[n].shape]
        if mismatched:
            raise CheckpointError(f"{path} does not fit layer {index}: {mismatched[:4]}; load "
                                  "it into the same model", path=path)
        weights[index] = state
    return weights


def _read_optimizer(step_dir: str, manifest: Manifest, parts: CheckpointParts
                    ) -> tuple[dict[ParamKey, Assembled], list[dict[str, Any]],
                               list[ZeroRegion] | None]:
    """The assembled state of every parameter this rank holds, from the files that have it."""
    mine = set(parts.layers)
    pp, dp, saved_tp = manifest.topology
    saved = Topology(pp, dp, saved_tp, manifest.ep, cp=manifest.cp)
    tp_rank = parts.topology.position(parts.rank).tp_rank
    grid = SavedGrid.of(manifest, parts.topology.tp, tp_rank)
    cuts = {key: cut_of(param) for key, param in parts.module.named_layer_parameters()}
    # under the same tp cuts a rank reads only its own tp rank's files, else every one (to
    # merge; the same tp with experts split or whole, expert_tensor_parallel, also merges)
    own = saved_tp == parts.topology.tp and grid.same_tp_cuts(cuts)
    files = [entry for entry in manifest.files if entry.role == "optimizer"
             and mine & set(entry.layers) and (not own or entry.rank % saved_tp == tp_rank)]
    payloads = [_read(step_dir, entry) for entry in files]
    positions = [saved.position(entry.rank) for entry in files]
    pieces = [((position.tp_rank, position.ep_rank), piece)
              for position, payload in zip(positions, payloads) for piece in payload["pieces"]]
    hyper = list(payloads[0]["hyper"]) if payloads else []
    keys = param_keys(parts.module.named_layer_parameters())
    regions = None
    if isinstance(parts.optimizer, ShardedOptimizer):
        if parts.zero_params_by_stage is None:
            raise CheckpointError("loading into a ShardedOptimizer needs zero_params_by_stage",
                                  path=step_dir)
        regions = zero_layout(parts.optimizer, parts.zero_params_by_stage, keys)
        wanted = wanted_ranges(parts.optimizer, regions)
    else:
        wanted = {key: (0, param.numel()) for key, param in parts.module.named_layer_parameters()
                  if param.requires_grad}
        if isinstance(parts.optimizer, torch.optim.Optimizer) and any(
                id(param) not in keys for group in parts.optimizer.param_groups
                for param in group["params"]):
            raise CheckpointError("this job's optimizer holds a parameter that is not in the "
                                  "PipelineModule's layers; build the optimizer from the "
                                  "engine's parameters", path=step_dir)
    if not all(isinstance(group, dict) and all(isinstance(k, str) for k in group)
               for group in hyper):
        raise CheckpointError(f"{files[0].path} in {step_dir}: its optimizer hyperparameters are "
                              "not a list of mappings; it was not written by this pipesched",
                              path=os.path.join(step_dir, files[0].path))
    shapes = {key: tuple(param.shape) for key, param in parts.module.named_layer_parameters()}
    state = assemble_resharded(pieces, wanted, cuts, shapes, grid, where=step_dir)
    wrong = [f"layer {key[0]} {key[1]!r}: saved {entry.shape}, here {shapes[key]}"
             for key, entry in state.items() if key in shapes and entry.shape != shapes[key]]
    if wrong:
        raise CheckpointError(f"{step_dir}: its optimizer state does not fit this model "
                              f"({'; '.join(wrong[:4])}); load it into the same model",
                              path=step_dir)
    return state, hyper, regions


def _apply(prepared: _Prepared, parts: CheckpointParts) -> None:
    layers = parts.layers
    with torch.no_grad():
        for index, state in prepared.weights.items():
            layers[index].load_state_dict(state)
    optimizer = parts.optimizer
    if prepared.optimizer_state is not None:
        if isinstance(optimizer, ShardedOptimizer):
            assert prepared.regions is not None
            import_zero(optimizer, prepared.regions, prepared.optimizer_state, prepared.hyper,
                        where=prepared.step_dir)
        elif optimizer is not None:
            keys = param_keys(parts.module.named_layer_parameters())
            import_torch_optimizer(optimizer, keys, prepared.optimizer_state, prepared.hyper,
                                   where=prepared.step_dir)
    if prepared.manifest.loss_scaler is not None and parts.loss_scaler is not None:
        parts.loss_scaler.load_state_dict(prepared.manifest.loss_scaler)
    if prepared.rng is not None:
        restore_rng(prepared.rng)
