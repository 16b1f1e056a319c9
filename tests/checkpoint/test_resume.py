"""Resume equivalence across killed processes: train N steps, save, kill every rank; a job
killed while saving step N+1 leaves step N as `latest`; a fresh job loads it and its next M
losses and final weights equal the uninterrupted run's exactly (same partition) or within
float tolerance (4 stages instead of 2, another cut and schedule)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pipeline import PipelineEngine, PipelineModule, RankFailedError, launch
from pipeline.checkpoint.manifest import LATEST, read_manifest
from pipeline.supervision import faults
from tests.support.equivalence import gathered_weights
from tests.support.fault_helpers import record_pid, surviving_ranks
from tests.support.pipeline_models import MODELS

pytestmark = pytest.mark.multiprocess

N, M = 3, 2  # steps before the checkpoint, steps after it
SPEC = MODELS["transformer"]


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def _engine(stages: int, schedule: str, partition: Any = "parameters") -> PipelineEngine:
    module = PipelineModule(SPEC.layers(), num_stages=stages, loss_fn=SPEC.loss,
                            partition_method=partition, base_seed=1234 + stages)
    return PipelineEngine(module, schedule=schedule, num_microbatches=4, optimizer=_adam,
                          timeout=20)


def _train(engine: PipelineEngine, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):  # the batch depends on the step only, so a resumed job sees the same
        inputs, targets = SPEC.batch(seed=engine.global_step, length=5 + engine.global_step % 3)
        losses.append(engine.train_batch(inputs, targets))
    return losses


def _uninterrupted_then_killed(root: str, results: str, pids: str) -> None:
    record_pid(pids)
    engine = _engine(2, "1f1b")
    losses = _train(engine, N)
    engine.save_checkpoint(root)
    losses += _train(engine, M)
    weights = gathered_weights(engine)
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "weights": weights}, results)
    dist.barrier()
    faults.kill_self()  # every rank dies as in a node failure: no cleanup runs


def _killed_while_saving(root: str, pids: str) -> None:
    record_pid(pids)
    engine = _engine(2, "1f1b")
    engine.load_checkpoint(root)
    _train(engine, 1)
    if dist.get_rank() == 1:  # dies after its first file is durable, before the rename
        engine.faults.arm("checkpoint.file", faults.kill_self)
    engine.save_checkpoint(root)


def _resume(root: str, stages: int, schedule: str, partition: Any) -> dict[str, Any]:
    engine = _engine(stages, schedule, partition)
    info = engine.load_checkpoint(root)
    losses = _train(engine, M)
    return {"loaded": info.step, "step": engine.global_step, "losses": losses,
            "weights": gathered_weights(engine), "rng": info.rng_restored}


def test_resume_after_kills_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    root, results, pids = (str(tmp_path / name) for name in ("ckpt", "results.pt", "pids"))
    with pytest.raises(RankFailedError, match="killed"):
        launch(_uninterrupted_then_killed, 2, root, results, pids, timeout=20, join_timeout=120)
    assert surviving_ranks(pids) == []
    reference = torch.load(results, weights_only=True)
    # a job killed mid-save: `latest` still names step N, the torn directory is refused
    with pytest.raises(RankFailedError) as caught:
        launch(_killed_while_saving, 2, root, pids, timeout=20, join_timeout=120)
    assert caught.value.rank == 1, str(caught.value)
    assert "signal 9" in str(caught.value) or "SIGKILL" in str(caught.value)
    assert surviving_ranks(pids) == []
    assert Path(root, LATEST).read_text().strip() == f"step_{N:06d}"
    torn = [name for name in os.listdir(root) if name.startswith(f"step_{N + 1:06d}")]
    assert len(torn) == 1 and not Path(root, torn[0], "manifest.json").exists()
    assert read_manifest(str(Path(root, f"step_{N:06d}"))).topology == (2, 1, 1)
    # same partition: bit for bit
    same = launch(_resume, 2, root, 2, "1f1b", "parameters", timeout=20, join_timeout=120)[0]
    assert (same["loaded"], same["step"], same["rng"]) == (N, N + M, True)
    assert same["losses"] == reference["losses"][N:]
    for key, value in reference["weights"].items():
        assert torch.equal(same["weights"][key], value), key
    # 4 stages, a uniform cut, GPipe: the same model, another float summation order
    other = launch(_resume, 4, root, 4, "gpipe", "uniform", timeout=20, join_timeout=120)[0]
    assert other["loaded"] == N and not other["rng"]  # another topology: generators untouched
    assert other["losses"] == pytest.approx(reference["losses"][N:], rel=1e-5, abs=1e-6)
    for key, value in reference["weights"].items():
        torch.testing.assert_close(other["weights"][key], value, rtol=1e-5, atol=1e-6)


def _mlp_engine(schedule: str) -> PipelineEngine:
    # the MLP, not the transformer: attention's key bias has a zero gradient up to rounding,
    # which Adam scales up to ±lr, so another summation order (dp) moves it visibly
    module = PipelineModule(MODELS["mlp"].layers(), num_stages=2, loss_fn=MODELS["mlp"].loss)
    return PipelineEngine(module, schedule=schedule, num_microbatches=2, optimizer=_adam,
                          timeout=20)


def _data_parallel_save(root: str) -> dict[tuple[int, str], torch.Tensor]:
    """pp = 2 × dp = 2, each replica on its half of the batch; save, then one more step."""
    engine = _mlp_engine("1f1b")
    half = engine.position.dp_rank
    for _ in range(2):
        inputs, targets = MODELS["mlp"].batch(seed=engine.global_step, batch=8)
        engine.train_batch(inputs[half * 4:(half + 1) * 4], targets[half * 4:(half + 1) * 4])
        if engine.global_step == 1:
            engine.save_checkpoint(root)
    return gathered_weights(engine)


def _full_batch_resume(root: str) -> dict[tuple[int, str], torch.Tensor]:
    engine = _mlp_engine("gpipe")
    engine.load_checkpoint(root)
    engine.train_batch(*MODELS["mlp"].batch(seed=engine.global_step, batch=8))
    return gathered_weights(engine)


def test_a_data_parallel_checkpoint_resumes_without_replicas(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    expected = launch(_data_parallel_save, 4, root, timeout=20, join_timeout=120)[0]
    manifest = read_manifest(str(Path(root, "step_000001")))
    assert manifest.topology == (2, 2, 1)
    # replicas hold the same weights and Adam state: only dp rank 0 (global 0 and 2) writes
    assert {entry.rank for entry in manifest.files if entry.role != "rng"} == {0, 2}
    resumed = launch(_full_batch_resume, 2, root, timeout=20, join_timeout=120)[0]
    for key, value in expected.items():
        torch.testing.assert_close(resumed[key], value, rtol=1e-5, atol=1e-6, msg=str(key))
