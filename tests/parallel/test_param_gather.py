"""ZeRO-1's parameter all-gather overlapped with the next step's forward (`overlap_param_gather`):
every layer's forward runs only after its own buckets arrived, the later buckets are still in
flight when the first layer starts, and whatever reads parameters between steps (checkpoints,
`finish_param_gather`) completes the gathers first. Equivalence with one process (fp32, two
steps, tied weights) is a case of `test_engine3d_equivalence.py`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline import PipelineConfigError, PipelineEngine, PipelineModule, launch
from pipeline.parallel.config import ParallelConfig
from pipeline.parallel.zero import ShardedOptimizer

WIDTH = 8


class _Probe(nn.Linear):
    """A Linear whose forward records which of its own buckets are still in flight (should be
    none) and how many gathers are in flight in all (the overlap: the later layers')."""

    def __init__(self) -> None:
        super().__init__(WIDTH, WIDTH)
        self.optimizer: ShardedOptimizer | None = None
        self.seen: list[tuple[int, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.optimizer is not None and torch.is_grad_enabled():
            mine = {key for p in self.parameters() for key in self.optimizer.buckets_of(p)}
            in_flight = self.optimizer.param_gather.in_flight
            self.seen.append((len(mine & in_flight), len(in_flight)))
        return super().forward(x)


def _engine(layers: list[Any], **options: Any) -> PipelineEngine:
    module = PipelineModule(layers, num_stages=1, loss_fn=F.mse_loss, base_seed=3)
    return PipelineEngine(module, num_microbatches=2, data_parallel=2, zero_stage=1,
                          optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2),
                          bucket_mb=2**-12, timeout=60, **options)


def _forward_waits(skip_wait: bool) -> dict[str, list[tuple[int, int]]]:
    """Two steps with probes as the first and last layers; `skip_wait` plants the bug of a
    forward that does not wait for its buckets (no hooks registered)."""
    if skip_wait:
        ShardedOptimizer.watch_forward = lambda self, modules: None  # type: ignore[method-assign]
    torch.manual_seed(0)
    first, last = _Probe(), _Probe()
    engine = _engine([first, *(nn.Linear(WIDTH, WIDTH) for _ in range(6)), last],
                     overlap_param_gather=True)
    assert isinstance(engine.optimizer, ShardedOptimizer)
    first.optimizer = last.optimizer = engine.optimizer
    rank = engine.position.dp_rank
    inputs, targets = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    for _ in range(2):
        engine.train_batch(inputs[rank * 4:rank * 4 + 4], targets[rank * 4:rank * 4 + 4])
    engine.stop_watchdog()
    return {"first": first.seen, "last": last.seen}


@pytest.mark.multiprocess
def test_each_forward_waits_for_its_own_buckets_while_later_ones_are_in_flight() -> None:
    for seen in launch(_forward_waits, 2, False, timeout=60, join_timeout=180):
        # step 0 has nothing in flight; step 1 (microbatches 0 and 1) has the step-0 gathers
        assert seen["first"][:2] == [(0, 0), (0, 0)], seen
        own_pending, in_flight = seen["first"][2]
        assert own_pending == 0 and in_flight > 0, seen  # the overlap: later buckets not waited
        assert all(own == 0 for own, _ in seen["last"]), seen


@pytest.mark.multiprocess
def test_planted_forward_without_the_wait_reads_buckets_in_flight() -> None:
    for seen in launch(_forward_waits, 2, True, timeout=60, join_timeout=180):
        assert seen["first"][2][0] > 0 and seen["last"][2][0] > 0, seen  # the check can fail


def _checkpoint_round_trip(root: str) -> dict[str, Any]:
    def layers() -> list[Any]:
        torch.manual_seed(0)
        return [nn.Linear(WIDTH, WIDTH) for _ in range(4)]

    def train(engine: PipelineEngine) -> list[float]:
        rank, losses = engine.position.dp_rank, []
        inputs, targets = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
        for _ in range(2):
            losses.append(engine.train_batch(inputs[rank * 4:rank * 4 + 4],
                                             targets[rank * 4:rank * 4 + 4]))
        return losses

    saving = _engine(layers(), overlap_param_gather=True)
    train(saving)
    assert isinstance(saving.optimizer, ShardedOptimizer)
    in_flight = len(saving.optimizer.param_gather.in_flight)
    saving.save_checkpoint(root)
    after_save = len(saving.optimizer.param_gather.in_flight)
    torch.manual_seed(5)
    straight = train(saving)
    saving.finish_param_gather()
    weights = {k: p.detach().clone() for k, p in saving.module.named_layer_parameters()}
    loading = _engine(layers(), overlap_param_gather=True)
    loading.load_checkpoint(root)
    torch.manual_seed(5)
    resumed = train(loading)
    loaded = dict(loading.module.state_dict())  # a state_dict completes the gathers itself
    for engine in (saving, loading):
        engine.stop_watchdog()
    return {"in_flight": in_flight, "after_save": after_save, "straight": straight,
            "resumed": resumed, "equal": all(torch.equal(loaded[f"stages.0.layers.{k}.{n}"], w)
                                             for (k, n), w in weights.items())}


@pytest.mark.multiprocess
def test_checkpoint_with_gathers_in_flight_saves_and_resumes_exactly(tmp_path: Path) -> None:
    for result in launch(_checkpoint_round_trip, 2, str(tmp_path / "ckpt"), timeout=60,
                         join_timeout=180):
        assert result["in_flight"] > 0 and result["after_save"] == 0, result
        assert result["resumed"] == result["straight"], result
        assert result["equal"], result


def test_overlap_param_gather_needs_zero_stage_1() -> None:
    with pytest.raises(PipelineConfigError, match=r"overlap_param_gather=True .* zero_stage=1"):
        ParallelConfig(overlap_param_gather=True)
    with pytest.raises(PipelineConfigError, match="overlap_param_gather must be True or False"):
        ParallelConfig(zero_stage=1, overlap_param_gather=1)  # type: ignore[arg-type]
