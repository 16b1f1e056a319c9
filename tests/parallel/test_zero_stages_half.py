"""ZeRO-2 and ZeRO-3 with half parameters (bf16 / fp16 weights, fp32 master shards): equal to
the single-process reference the ZeRO-1 half case uses, and holding exactly the bytes the
accounting prices, at or under DeepSpeed's 2 + 14/d and 16/d per parameter."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline import PipelineEngine, PipelineModule, launch
from pipeline.parallel.model_state import count_model_states
from pipeline.parallel.zero import ShardedOptimizer
from pipeline.parallel.zero3 import FullyShardedOptimizer
from schedules.analysis.accounting import model_state_bytes
from tests.support.engine3d_models import MODELS, OPTIMIZERS, Case, run_case
from tests.support.equivalence import gathered_weights

HALF_TOLERANCE = 2e-2
"""bf16 parameters: the ZeRO-1 half case's tolerance (test_model_states.py)."""

CASES = [
    Case("bf16 half params tied pp2×dp2 ZeRO-2 Adam +clip", "tied",
         {"data_parallel": 2, "zero_stage": 2, "precision": "bf16", "half_parameters": True,
          "gradient_clipping": 0.05}, optimizer="adam"),
    Case("bf16 half params tied pp2×dp2 ZeRO-3 Adam +clip", "tied",
         {"data_parallel": 2, "zero_stage": 3, "precision": "bf16", "half_parameters": True,
          "gradient_clipping": 0.05}, optimizer="adam"),
    Case("bf16 half params pp2×dp2 ZeRO-3", "mlp",
         {"data_parallel": 2, "zero_stage": 3, "precision": "bf16", "half_parameters": True,
          "bucket_mb": 2**-10}),
    Case("fp16 half params pp2×dp2 ZeRO-2", "mlp",
         {"data_parallel": 2, "zero_stage": 2, "precision": "fp16", "half_parameters": True,
          "initial_loss_scale": 2.0**10, "bucket_mb": 2**-10}),
    Case("fp16 half params interleaved pp2×dp2 ZeRO-3", "mlp",
         {"data_parallel": 2, "zero_stage": 3, "precision": "fp16", "half_parameters": True,
          "initial_loss_scale": 2.0**10, "bucket_mb": 2**-10}, schedule="interleaved",
         chunks=2),
]
"""Against `reference_step` (two steps; run_case reads the parameters between them, so ZeRO-3
gathers and frees exposed layers as a checkpoint would)."""

WIDTH, LAYERS = 128, 4
BUCKET_MB = 2**-6
"""16 KiB buckets: a layer spans several, so the layout's padding shows in the oracle."""


def _run_cases() -> list[dict[str, Any]]:
    return [run_case(case) for case in CASES]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_half_parameters_under_zero_2_and_3_equal_one_process() -> None:
    for results in launch(_run_cases, 4, timeout=60, join_timeout=600):
        for result in results:
            assert result["loss"] < HALF_TOLERANCE, result
            assert result["param"] < HALF_TOLERANCE, result
            assert result["grad_relative"] < HALF_TOLERANCE, result
            case = next(c for c in CASES if c.name == result["case"])
            if "gradient_clipping" in case.engine:
                assert result["clipped"], f"{case.name}: the clipping threshold never bit"
        # ZeRO-3 steps the same fp32 masters from the same half gradients as ZeRO-2: the same
        # errors to the last bit (a master rounded to bf16, or a tied weight left behind, is not)
        two, three = (next(r for r in results if r["case"] == c.name) for c in CASES[:2])
        for what in ("loss", "grad", "param", "grad_relative"):
            assert three[what] == pytest.approx(two[what], rel=1e-6, abs=1e-9), (what, two, three)


def _expected_bytes(sizes: list[int], precision: str, zero: int, d: int) -> int:
    """The oracle, from the definitions: a stage's parameters laid end to end in one region
    per stage (ZeRO-2) or per layer (ZeRO-3), k buckets of d·s elements (B = d·floor(bucket
    bytes / (2 · d)) half elements per bucket), this rank's (k, s) shard. Held after the step:
    ZeRO-2 the half parameters, the half gradient shard, the fp32 master shard; ZeRO-3 the
    half gradient shard and the fp32 master shard (its gathered layers are freed). Adam's two
    fp32 moments are counted separately (they cover only the pieces a rank steps)."""
    regions = [sum(sizes)] if zero == 2 else [
        sum(sizes[i:i + 2]) for i in range(0, len(sizes), 2)]  # weight + bias per layer
    per_bucket = d * max(1, int(BUCKET_MB * 2**20) // (2 * d))
    total = 0
    for n in regions:
        buckets = math.ceil(n / per_bucket)
        shard = buckets * math.ceil(n / (buckets * d))
        total += (2 * d * shard if zero == 2 else 0) + 2 * shard + 4 * shard
    del precision
    return total


def _count(zero: int, precision: str, dp: int) -> dict[str, Any]:
    torch.manual_seed(0)
    module = PipelineModule([nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)], num_stages=1,
                            loss_fn=F.mse_loss)
    engine = PipelineEngine(module, num_microbatches=2, data_parallel=dp, zero_stage=zero,
                            precision=precision, half_parameters=True, bucket_mb=BUCKET_MB,
                            initial_loss_scale=2.0**4, timeout=60,
                            optimizer=lambda p: torch.optim.Adam(p, lr=1e-3))
    engine.train_batch(torch.randn(4 * dp, WIDTH), torch.randn(4 * dp, WIDTH))
    counted = count_model_states(module, engine.optimizer)
    moments = engine.optimizer.state_bytes()  # type: ignore[union-attr]
    sizes = [p.numel() for p in module.parameters()]
    row = {"zero": zero, "precision": precision, "d": dp, "skipped": engine.last_step_skipped,
           "counted": counted.total, "per_parameter": counted.per_parameter,
           "expected": _expected_bytes(sizes, precision, zero, dp) + moments,
           "n": counted.num_parameters}
    engine.stop_watchdog()
    return row


def _count_all() -> list[dict[str, Any]]:
    return [_count(zero, precision, 4) for zero in (2, 3) for precision in ("bf16", "fp16")]


@pytest.mark.multiprocess
def test_half_zero_2_and_3_hold_the_accounted_bytes_within_deepspeeds_figures() -> None:
    for rows in launch(_count_all, 4, timeout=60, join_timeout=300):
        for row in rows:
            label = f"{row['precision']} ZeRO-{row['zero']} dp{row['d']}"
            assert not row["skipped"], label  # the step ran: Adam's moments exist
            assert row["counted"] == row["expected"], (label, row)
            accounted = model_state_bytes(row["precision"], zero_stage=row["zero"],
                                          data_parallel=row["d"]).total
            assert abs(row["per_parameter"] / accounted - 1) <= 0.01, (label, row, accounted)
            deepspeed = 2 + 14 / row["d"] if row["zero"] == 2 else 16 / row["d"]
            assert row["per_parameter"] <= deepspeed * 1.01, (label, row, deepspeed)


def _expose_and_free() -> dict[str, bool]:
    """ZeRO-3 bf16: read every layer (as a checkpoint does), free them; then write one."""
    torch.manual_seed(0)
    module = PipelineModule([nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)], num_stages=1,
                            loss_fn=F.mse_loss)
    engine = PipelineEngine(module, num_microbatches=2, data_parallel=2, zero_stage=3,
                            precision="bf16", half_parameters=True, timeout=60,
                            optimizer=lambda p: torch.optim.Adam(p, lr=1e-3))
    engine.train_batch(torch.randn(8, WIDTH), torch.randn(8, WIDTH))
    sharded = engine.optimizer
    assert isinstance(sharded, FullyShardedOptimizer)
    before = [master.detach().clone() for master in sharded.masters()]
    finer = any(bool((m != m.to(torch.bfloat16).float()).any()) for m in before)
    module.state_dict()  # gathers every layer for reading
    for key in sharded.gathered_units():
        sharded.free(key)
    kept = all(torch.equal(a, b) for a, b in zip(before, sharded.masters()))
    module.state_dict()
    weight = next(module.parameters())
    with torch.no_grad():
        weight.fill_(0.5)
    for key in sharded.gathered_units():
        sharded.free(key)
    written = any(bool((master == 0.5).any()) for master in sharded.masters())
    engine.stop_watchdog()
    return {"finer": finer, "kept": kept, "written": written}


@pytest.mark.multiprocess
def test_zero3_reading_half_parameters_keeps_the_fp32_masters_and_takes_writes() -> None:
    for row in launch(_expose_and_free, 2, timeout=60, join_timeout=300):
        assert row["finer"], row  # the masters hold more than bf16 can (else nothing to lose)
        assert row["kept"], row
        assert row["written"], row


def _step_peak(zero: int) -> float:
    """The most model-state bytes per parameter alive during one bf16 step (pp1 × dp4, 8
    layers): sampled after each layer's gather, each gradient's arrival in its bucket and
    around the inner step (fp32 gradient copies, new moments); gathered layers and bucket
    buffers count."""
    torch.manual_seed(0)
    module = PipelineModule([nn.Linear(256, 256) for _ in range(8)], num_stages=1,
                            loss_fn=F.mse_loss)
    engine = PipelineEngine(module, num_microbatches=4, data_parallel=4, zero_stage=zero,
                            precision="bf16", half_parameters=True, timeout=60,
                            optimizer=lambda p: torch.optim.Adam(p, lr=1e-3))
    sharded = engine.optimizer
    assert isinstance(sharded, ShardedOptimizer)
    peak, built = [0], engine.module

    def sample(*_: object) -> None:
        live = count_model_states(built, sharded).total + sharded.transient_bytes()
        peak[0] = max(peak[0], live)
    for layer in built.modules():
        if isinstance(layer, nn.Linear):
            layer.register_forward_pre_hook(sample)
            for param in layer.parameters():
                param.register_post_accumulate_grad_hook(sample)
    sharded.optimizer.register_step_pre_hook(sample)
    sharded.optimizer.register_step_post_hook(sample)  # the moments exist from the first step
    engine.train_batch(torch.randn(32, 256), torch.randn(32, 256))
    engine.stop_watchdog()
    return peak[0] / sum(p.numel() for p in built.parameters())


def _peaks() -> dict[int, float]:
    return {zero: _step_peak(zero) for zero in (1, 3)}


@pytest.mark.multiprocess
def test_zero3_step_peak_is_at_most_six_tenths_of_zero1s_at_d4() -> None:
    for peaks in launch(_peaks, 4, timeout=60, join_timeout=300):
        # ZeRO-1: 6 + 12/4 = 9 held whole; ZeRO-3: 14/4 + one layer gathered + two buckets
        # in flight + the step's fp32 gradient copies (4/4)
        assert peaks[1] == pytest.approx(9.0, rel=0.01), peaks
        assert peaks[3] <= 0.6 * peaks[1], peaks


def _half_checkpoint(root: str, zero: int, resume: bool) -> dict[str, Any]:
    """Two bf16 steps saved (or the checkpoint loaded), then two more: losses and weights."""
    spec = MODELS["mlp"]
    module = PipelineModule(spec.layers(), num_stages=2, loss_fn=spec.loss, base_seed=7)
    engine = PipelineEngine(module, num_microbatches=4, optimizer=OPTIMIZERS["adam"],
                            data_parallel=2, zero_stage=zero, precision="bf16",
                            half_parameters=True, timeout=60)
    if resume:
        engine.load_checkpoint(root)
    losses = []
    for _ in range(2 if resume else 4):
        inputs, targets = spec.batch(engine.global_step, 16)
        mine = slice(8 * engine.position.dp_rank, 8 * engine.position.dp_rank + 8)
        losses.append(engine.train_batch(inputs[mine], targets[mine]))
        if not resume and engine.global_step == 2:
            engine.save_checkpoint(root)
    engine.stop_watchdog()
    return {"losses": losses[-2:], "weights": gathered_weights(engine)}


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("zero", [2, 3])
def test_half_zero_2_and_3_checkpoints_resume_exactly_with_their_fp32_masters(
        tmp_path: Path, zero: int) -> None:
    # saving reads (ZeRO-3: gathers) the bf16 parameters; rounding the masters to them, or
    # losing them, would make the resumed run step differently
    root = str(tmp_path)
    straight = launch(_half_checkpoint, 4, root, zero, False, timeout=60, join_timeout=240)
    resumed = launch(_half_checkpoint, 4, root, zero, True, timeout=60, join_timeout=240)
    assert resumed[0]["losses"] == straight[0]["losses"]
    for key, value in straight[0]["weights"].items():
        assert value.dtype == torch.bfloat16, key
        assert torch.equal(resumed[0]["weights"][key], value), key
