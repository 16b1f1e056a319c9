"""ZeRO-1 checkpoints re-shard: Adam state saved by 2 data-parallel shards loads into 3 shards
and into a plain (unsharded) optimizer, and the next step equals the uninterrupted run's.

Tested at the `ShardedOptimizer` level over a plain dp group (p = 1, the whole model on
every rank): the engine does not build a ShardedOptimizer itself yet (the dp/ZeRO wiring is
on the `engine3d` branch); `PipelineEngine.save_checkpoint` hands one to the same code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipeline import PipelineModule, Topology, launch
from pipeline.checkpoint.load import load_checkpoint
from pipeline.checkpoint.manifest import read_manifest
from pipeline.checkpoint.optimizer_state import assemble, make_piece
from pipeline.checkpoint.save import CheckpointParts, save_checkpoint
from pipeline.checkpoint.zero_state import import_zero, wanted_ranges, zero_layout
from pipeline.parallel.zero import ShardedOptimizer
from tests.support.pipeline_models import mlp_batch, mlp_layers

pytestmark = pytest.mark.multiprocess

BATCH = 24  # splits evenly over 1, 2 and 3 replicas


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


class _Replica:
    """This rank's copy of the model and its ZeRO-1 shard of the Adam state."""

    def __init__(self, base_seed: int, bucket_mb: float) -> None:
        self.module = PipelineModule(mlp_layers(), num_stages=1, loss_fn=F.mse_loss,
                                     base_seed=base_seed)
        self.module.materialize([0])
        self.regions = {0: self.module.stage_parameters(0)}
        # small buckets: each rank owns a piece of every bucket, so a parameter is saved in
        # several pieces per rank (Megatron's per-bucket shards)
        self.optimizer = ShardedOptimizer(self.regions, _adam, None, bucket_mb=bucket_mb)
        self.step = 0

    def train(self, steps: int) -> None:
        d, r = dist.get_world_size(), dist.get_rank()
        share = BATCH // d
        for _ in range(steps):
            inputs, targets = mlp_batch(seed=self.step, batch=BATCH)
            self.optimizer.zero_grad()
            local = slice(r * share, (r + 1) * share)
            F.mse_loss(self.module(inputs[local]), targets[local]).backward()
            self.optimizer.step()  # reduce-scatter the mean gradient, step the shard, gather
            self.step += 1

    def parts(self) -> CheckpointParts:
        return CheckpointParts(module=self.module, topology=Topology(1, dist.get_world_size()),
                               rank=dist.get_rank(), step=self.step, optimizer=self.optimizer,
                               zero_params_by_stage=self.regions)


def _weights(module: PipelineModule) -> dict[tuple[int, str], torch.Tensor]:
    return {key: p.detach().clone() for key, p in module.named_layer_parameters()}


def _save_then_continue(root: str) -> dict[tuple[int, str], torch.Tensor]:
    replica = _Replica(base_seed=1, bucket_mb=2**-14)
    replica.train(2)
    save_checkpoint(root, replica.parts())
    replica.train(1)
    return _weights(replica.module)


def _load_and_step(root: str) -> dict[tuple[int, str], torch.Tensor]:
    replica = _Replica(base_seed=2, bucket_mb=2**-13)  # other buckets when loading
    replica.step = load_checkpoint(root, replica.parts()).step
    replica.train(1)
    return _weights(replica.module)


def test_zero1_state_reshards_to_another_data_parallel_size(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    expected = launch(_save_then_continue, 2, root, timeout=20, join_timeout=120)[0]
    manifest = read_manifest(str(tmp_path / "ckpt" / "step_000002"))
    assert manifest.optimizer == "zero" and manifest.topology == (1, 2, 1)
    assert [f.path for f in manifest.files if f.role == "optimizer"] == [
        "optim_rank_0000.pt", "optim_rank_0001.pt"]  # one shard per dp rank
    saved = torch.load(tmp_path / "ckpt" / "step_000002" / "optim_rank_0000.pt",
                       weights_only=True)
    params = {(piece["layer"], piece["name"]) for piece in saved["pieces"]}
    assert len(saved["pieces"]) > 2 * len(params)  # a parameter in a piece of every bucket
    # dp = 3: each rank assembles its new shard from pieces of both saved shards
    for rank, weights in enumerate(launch(_load_and_step, 3, root, timeout=20,
                                          join_timeout=120)):
        for key, value in expected.items():
            torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-6,
                                       msg=f"dp=3 rank {rank} {key}")
    # dp = 1 with a plain torch Adam: the shards join into full per-parameter state
    module = PipelineModule(mlp_layers(), num_stages=1, loss_fn=F.mse_loss, base_seed=3)
    module.materialize([0])
    adam = _adam(module.parameters())
    parts = CheckpointParts(module=module, topology=Topology(1), rank=0, optimizer=adam)
    assert load_checkpoint(root, parts).step == 2
    inputs, targets = mlp_batch(seed=2, batch=BATCH)
    F.mse_loss(module(inputs), targets).backward()
    adam.step()
    for key, value in _weights(module).items():
        torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-6, msg=str(key))


def _old_layout_pieces(named: list[tuple[tuple[int, str], torch.Tensor]], d: int,
                       full: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """What the one-range-per-rank layout saved: the region laid end to end, padded to d·S
    with S = ceil(N / d), rank r's pieces the overlaps of [r·S, (r+1)·S) with each parameter."""
    numel = sum(param.numel() for _, param in named)
    size = -(-numel // d)
    pieces, offset = [], 0
    for key, param in named:
        for r in range(d):
            lo, hi = max(offset, r * size), min(offset + param.numel(), (r + 1) * size)
            if lo < hi:
                pieces.append(make_piece(key, param.shape, lo - offset, hi - offset,
                                         {n: v[lo:hi] for n, v in full.items() if n != "master"},
                                         {"step": torch.tensor(3.0)}, master=full["master"][lo:hi]))
        offset += param.numel()
    return pieces


def _load_old_layout() -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    replica = _Replica(base_seed=1, bucket_mb=2**-14)  # 16-element buckets: many per weight
    named = [(key, p) for key, p in replica.module.named_layer_parameters()]
    numel = sum(p.numel() for _, p in named)
    full = {name: torch.arange(numel, dtype=torch.float32) + shift
            for shift, name in enumerate(("master", "exp_avg", "exp_avg_sq"))}
    keys = {id(p): key for key, p in named}
    regions = zero_layout(replica.optimizer, replica.regions, keys)
    state = assemble(_old_layout_pieces(named, 2, full),
                     wanted_ranges(replica.optimizer, regions), where="old layout")
    import_zero(replica.optimizer, regions, state, [], where="old layout")
    (master,) = replica.optimizer.masters()
    layout = replica.optimizer.layouts()[0]
    assert world_size == 2 and layout.num_buckets > 2, layout
    # the ownership oracle: rank r holds element i when (i mod d·s) // s == r
    width = world_size * layout.piece
    mine = [i for i in range(layout.size) if (i % width) // layout.piece == rank]
    for name in ("master", "exp_avg", "exp_avg_sq"):
        loaded = master if name == "master" else replica.optimizer.shard_state(name)[0]
        expected = torch.tensor([float(full[name][i]) if i < numel else 0.0  # padding
                                 for i in mine])
        torch.testing.assert_close(loaded.detach().reshape(-1), expected, rtol=0, atol=0,
                                   msg=name)


def test_zero1_state_saved_in_the_one_range_layout_loads_into_per_bucket_shards() -> None:
    launch(_load_old_layout, 2, timeout=20, join_timeout=120)
