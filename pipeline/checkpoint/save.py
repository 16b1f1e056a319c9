"""Save a training checkpoint so that a crash at any moment leaves a loadable one.

What is saved (layout in `pipeline.checkpoint.manifest`): weights per global layer (per tp
slice, and the experts of each ep rank: `pipeline.checkpoint.reshard` says why per slice and
how a load under another tp or ep re-cuts them), optimizer state per (layer, parameter) and
element range (`pipeline.checkpoint.optimizer_state`, ZeRO-1 shards through
`pipeline.checkpoint.zero_state`), every rank's random generators, the loss scaler and step
counter, and a manifest with the topology, how each split parameter was cut and a sha256 per
file.

Why a crash cannot tear it — the order of a save (a collective: every rank calls it)::

    0. rank 0 takes the root's lock (once per job: `pipeline.checkpoint.root_lock`)
    1. rank 0 makes a staging directory  root/step_000042.partial-<token>/
    2. every rank writes its files there (temporary name, fsync, rename), through a
       descriptor of it opened with O_NOFOLLOW (`pipeline.checkpoint.staging`: a symlink
       swapped in under its name cannot redirect a write)
    3. rank 0 writes manifest.json into it, last (same way)
    4. rank 0 renames the staging directory to root/step_000042/      <- the commit
    5. rank 0 points root/latest at it (temporary file, fsync, rename)

Before 4 nothing outside the staging directory changed, so `latest` still names the
previous complete checkpoint; a staging directory has no manifest until every file is
durable, and a loader refuses a directory without one.

A save that fails with an error (a full disk: ENOSPC) rather than a crash cleans up before it
raises: the staging directory and temporary files go, and the error says what `latest`
names; after step 4, that the step directory is complete although `latest` was not moved.
What a crash leaves, the next save sweeps (under the lock, so never another job's save).

What a rank hands in is a `pipeline.checkpoint.parts.CheckpointParts`; the collectives that
make every rank agree are `pipeline.checkpoint.agreement` (both re-exported here).
"""

from __future__ import annotations

import functools
import io
import os
import secrets
from collections.abc import Callable, Mapping
from typing import Any

import torch

from pipeline.checkpoint.agreement import agree, gather_from_ranks
from pipeline.checkpoint.atomic_files import atomic_write, sha256_bytes
from pipeline.checkpoint.commit import abandon, commit, latest_status
from pipeline.checkpoint.manifest_schema import (
    LATEST,
    FileEntry,
    Manifest,
    SavedSplit,
    dump_manifest,
    step_name,
)
from pipeline.checkpoint.optimizer_state import export_torch_optimizer, hyperparameters, param_keys
from pipeline.checkpoint.parts import CheckpointInfo, CheckpointParts, Stateful
from pipeline.checkpoint.pointer import read_run_id
from pipeline.checkpoint.reshard import module_splits
from pipeline.checkpoint.rng_state import capture_rng
from pipeline.checkpoint.root_lock import lock_root
from pipeline.checkpoint.staging import StagingDirectory, create_staging, join_staging
from pipeline.checkpoint.zero_state import export_zero, zero_layout
from pipeline.errors import CheckpointError
from pipeline.parallel.param_marks import expert_shard
from pipeline.parallel.zero import ShardedOptimizer

__all__ = ["CheckpointInfo", "CheckpointParts", "Stateful", "agree", "layer_file",
           "optimizer_file", "rng_file", "save_checkpoint"]


def layer_file(index: int, tp_rank: int | None = None, ep_rank: int = 0) -> str:
    """File name of layer `index`'s weights (per tensor-parallel rank when tp > 1); with
    `ep_rank` > 0 the experts that expert-parallel rank holds (ep rank 0's are in the
    layer's own file)."""
    shard = "" if tp_rank is None else f"-tp_{tp_rank:02d}"
    experts = f"-ep_{ep_rank:02d}" if ep_rank else ""
    return f"layer_{index:02d}{shard}{experts}-model_states.pt"


def optimizer_file(rank: int) -> str:
    return f"optim_rank_{rank:04d}.pt"


def rng_file(rank: int) -> str:
    return f"rng_rank_{rank:04d}.pt"


def _serialize(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _payloads(parts: CheckpointParts) -> list[tuple[str, str, tuple[int, ...], Callable[[], Any]]]:
    """(file name, role, layers, make the value) of every file this rank writes."""
    position = parts.topology.position(parts.rank)
    tp_rank = position.tp_rank if parts.topology.tp > 1 else None
    files: list[tuple[str, str, tuple[int, ...], Callable[[], Any]]] = []
    layers = parts.layers
    # data- and context-parallel ranks hold the same weights and optimizer state, but for
    # the experts: the first ep of the stage's dp × cp ranks (dp-major, as ep is carved)
    # hold different ones (ep rank 0's are in the layer file); ep = 1: dp and cp rank 0
    replica = position.dp_rank * parts.topology.cp + position.cp_rank
    writes = replica < parts.topology.ep
    ep_rank = position.ep_rank if writes else -1
    for index, layer in sorted(layers.items()):
        state = layer.state_dict()
        if ep_rank > 0:
            experts = {name for name, param in layer.named_parameters()
                       if expert_shard(param) is not None}
            state = {name: value for name, value in state.items() if name in experts}
        if state and ep_rank >= 0:  # a parameter-free layer has nothing to keep
            files.append((layer_file(index, tp_rank, max(ep_rank, 0)), "layer", (index,),
                          functools.partial(_compact, state)))
    kind = parts.optimizer_kind
    if kind == "zero" or (kind == "torch" and ep_rank >= 0):
        files.append((optimizer_file(parts.rank), "optimizer", tuple(sorted(layers)),
                      lambda: _optimizer_payload(parts, experts_only=ep_rank > 0)))
    files.append((rng_file(parts.rank), "rng", (), capture_rng))
    for name, data in parts.extra_files.items():
        files.append((name, "client", (), functools.partial(bytes, data)))
    return files


def _compact(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies with their own storage: a view (a ZeRO flat buffer) would save the whole buffer."""
    return {name: value.detach().clone() for name, value in state.items()}


def _optimizer_payload(parts: CheckpointParts, experts_only: bool = False) -> dict[str, Any]:
    """This rank's optimizer pieces; `experts_only`: a plain optimizer on ep rank > 0, whose
    dense state ep rank 0 saves."""
    keys = param_keys(parts.module.named_layer_parameters())
    optimizer = parts.optimizer
    if isinstance(optimizer, ShardedOptimizer):
        if parts.zero_params_by_stage is None:
            raise CheckpointError("a ShardedOptimizer checkpoint needs zero_params_by_stage "
                                  "(the params_by_stage it was built with)", path="<parts>")
        regions = zero_layout(optimizer, parts.zero_params_by_stage, keys)
        return {"kind": "zero", "class": parts.optimizer_class,
                "hyper": hyperparameters(optimizer.optimizer),
                "pieces": export_zero(optimizer, regions)}
    assert optimizer is not None  # _payloads writes this file only with an optimizer
    pieces = export_torch_optimizer(optimizer, keys)
    if experts_only:
        experts = {keys[id(param)] for _, param in parts.module.named_layer_parameters()
                   if expert_shard(param) is not None}
        pieces = [piece for piece in pieces if (piece["layer"], piece["name"]) in experts]
    return {"kind": "torch", "class": parts.optimizer_class,
            "hyper": hyperparameters(optimizer), "pieces": pieces}


def _write_files(staging: StagingDirectory, parts: CheckpointParts) -> list[FileEntry]:
    entries = []
    for name, role, layers, make in _payloads(parts):
        value = make()
        data = value if isinstance(value, bytes) else _serialize(value)
        atomic_write(name, data, dir_fd=staging.fd,
                     before_rename=lambda: parts.reach("checkpoint.file"))
        entries.append(FileEntry(name, sha256_bytes(data), len(data), role, parts.rank, layers))
    return entries


def save_checkpoint(root: str, parts: CheckpointParts) -> CheckpointInfo:
    """Write `root/step_<step>/` and point `root/latest` at it (a collective; see the module
    docstring for the order that makes it crash-safe). Returns where it went.

    `CheckpointRootLockedError` when another process holds `root`; `CheckpointError` when a
    write fails (a full disk): the failed save's files are removed first and the message says
    what `latest` names now."""
    if not isinstance(root, str | os.PathLike) or not str(root):
        raise CheckpointError(f"checkpoint directory must be a non-empty path, got {root!r}",
                              path=str(root))
    root = os.fspath(root)
    if isinstance(parts.optimizer, ShardedOptimizer):
        parts.optimizer.finish_param_gather()  # the weights written are the updated ones
    final_name = step_name(parts.step)
    token = gather_from_ranks(secrets.token_hex(4) if parts.rank == 0 else None)[0]
    # the run this root belongs to: the one `latest` records, else a new one
    run_id = (read_run_id(os.path.join(root, LATEST)) or secrets.token_hex(8)) \
        if parts.rank == 0 else ""
    staging_name = f"{final_name}.partial-{token}"
    staging: StagingDirectory | None = None
    problem: CheckpointError | None = None
    if parts.rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            lock_root(root)  # this job's root from now on; see root_lock for why a lock
            # held open from here on: every write goes through its descriptor (`staging`)
            staging = create_staging(root, staging_name, parts.reach)
        except OSError as error:
            problem = CheckpointError(f"cannot create {error.filename or root}: {error}",
                                      path=root)
        except CheckpointError as error:
            problem = error
    try:
        agree(problem, "taking the checkpoint directory")  # before any rank writes into it
        return _write_and_commit(root, staging_name, staging, parts, final_name, token,
                                 run_id)
    finally:
        if staging is not None:
            staging.close()


def _write_and_commit(root: str, staging_name: str, staging: StagingDirectory | None,
                      parts: CheckpointParts, final_name: str, token: str,
                      run_id: str) -> CheckpointInfo:
    """Steps 2-5 of a save (the module docstring); `staging` is rank 0's open directory."""
    problem: CheckpointError | None = None
    entries: list[FileEntry] = []
    mine = staging
    try:
        if mine is None:  # rank 0 made it, fresh (create_staging in save_checkpoint)
            mine = join_staging(root, staging_name)
        entries = _write_files(mine, parts)
    except OSError as error:
        problem = CheckpointError(f"cannot write into {os.path.join(root, staging_name)}: "
                                  f"{error}", path=os.path.join(root, staging_name))
    except CheckpointError as error:
        problem = error
    finally:
        if mine is not None and mine is not staging:
            mine.close()
    try:
        agree(problem, "writing the checkpoint files")
    except CheckpointError as error:
        if staging is not None:  # every rank has stopped writing: nothing of this save is kept
            abandon(staging)
        raise CheckpointError(f"{error}; nothing was committed, the staging directory is "
                              f"removed and {latest_status(root)}", path=error.path) from None
    gathered = gather_from_ranks((entries, module_splits(parts.module.named_layer_parameters())))
    if staging is not None:
        splits = {(split.layer, split.name): split for _, rank_splits in gathered
                  for split in rank_splits}
        manifest = _manifest(parts, [entry for rank_entries, _ in gathered
                                     for entry in rank_entries], run_id,
                             tuple(splits[key] for key in sorted(splits)))
        problem = commit(staging, final_name, dump_manifest(manifest), token, parts.reach,
                         run_id)
    agree(problem, "committing the checkpoint")
    return CheckpointInfo(os.path.join(root, final_name), parts.step)


def _manifest(parts: CheckpointParts, entries: list[FileEntry], run_id: str,
              splits: tuple[SavedSplit, ...]) -> Manifest:
    topology = parts.topology
    return Manifest(
        step=parts.step, world_size=topology.world_size,
        topology=(topology.pp, topology.dp, topology.tp), num_layers=parts.module.num_layers,
        boundaries=tuple(parts.module.boundaries), schedule=parts.schedule,
        num_microbatches=parts.num_microbatches, optimizer=parts.optimizer_kind,
        optimizer_class=parts.optimizer_class,
        loss_scaler=None if parts.loss_scaler is None else parts.loss_scaler.state_dict(),
        files=tuple(sorted(entries, key=lambda entry: entry.path)), run_id=run_id,
        ep=topology.ep, splits=splits, cp=topology.cp)
