"""3D-parallel engine = one process: pp2×dp2, pp2×tp2, ZeRO-1, interleaved, tied embedding/head,
bf16, and the fp16 overflow vote, each two optimizer steps against the reference.

One 4-process launch runs every configuration (fresh engine and groups per case) and the
up-front refusals; the 8-process grid (pp2×dp2×tp2) is in `test_engine3d_grid.py`.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pipeline import PipelineConfigError, PipelineEngine, PipelineModule, launch
from pipeline.model.reference import build_reference, reference_step
from tests.support.engine3d_models import CASES, MODELS, Case, run_case, spike_layers

pytestmark = pytest.mark.multiprocess

FP32_TOLERANCE = 2e-5
"""Absolute (gradients, parameters) and relative (loss) error for fp32 runs."""
BF16_TOLERANCE = 2e-2
"""bf16 keeps 8 mantissa bits (2^-8 ≈ 4e-3 per rounding); after a few layers we state 2 %
relative for the loss and the gradient vector, and 2e-2 absolute for parameters after two
SGD steps (lr 0.1), against the fp32 reference."""
FP16_TOLERANCE = 5e-3
"""fp16 keeps 11 bits: the parameters after the one step taken agree within this."""


def _refusals() -> list[str]:
    """Errors raised on every rank before any collective (no rank can hang)."""
    messages = []
    for kwargs in ({"data_parallel": 4}, {"zero_stage": 3, "overlap_param_gather": True},
                   {"precision": "fp8", "gradient_clipping": -1.0}):
        module = PipelineModule(MODELS["mlp"].layers(), num_stages=2)
        try:
            PipelineEngine(module, schedule="1f1b", num_microbatches=2, **kwargs)
        except PipelineConfigError as error:
            messages.append(str(error))
        else:
            messages.append("")
    return messages


def _overflow(zero_stage: int) -> dict[str, Any]:
    """fp16 on pp2×dp2; global rank 1 alone overflows in step 0: every rank must skip it,
    halve the scale, then take step 1 as the reference does from the initial weights."""
    model, factory = MODELS["spike"], (lambda ps: torch.optim.SGD(ps, lr=0.1))
    module = PipelineModule(model.layers(), num_stages=2, loss_fn=model.loss)
    engine = PipelineEngine(module, schedule="1f1b", num_microbatches=4, optimizer=factory,
                            data_parallel=2, precision="fp16", initial_loss_scale=2.0**10,
                            zero_stage=zero_stage)
    initial = {key: p.detach().clone() for key, p in module.named_layer_parameters()}
    dp_rank = engine.position.dp_rank
    skipped, scales = [], []
    for step in range(2):
        inputs, targets = model.batch(step, 16)
        engine.train_batch(inputs[dp_rank * 8:(dp_rank + 1) * 8],
                           targets[dp_rank * 8:(dp_rank + 1) * 8])
        skipped.append(engine.last_step_skipped)
        scales.append(engine.loss_scale)
        if step == 0:
            unchanged = all(torch.equal(p, initial[key])
                            for key, p in module.named_layer_parameters())
    inputs, targets = model.batch(1, 16)
    # the reference's Spike never fires (rank -1): it would fire on rank 1 here too
    expected = reference_step(build_reference(spike_layers(rank=-1)), inputs, targets,
                              loss_fn=model.loss, optimizer=factory)
    error = max(float((p.detach() - expected.params[key]).abs().max())
                for key, p in module.named_layer_parameters())
    return {"skipped": skipped, "scales": scales, "unchanged": unchanged, "error": error}


def _four_ranks(cases: list[Case]) -> dict[str, Any]:
    torch.manual_seed(0)
    return {"refusals": _refusals(), "results": [run_case(case) for case in cases],
            "overflow": [_overflow(zero_stage) for zero_stage in (0, 1)]}


@pytest.fixture(scope="module")
def per_rank() -> list[dict[str, Any]]:
    """The one 4-process launch every test of this file reads (hard deadline 240 s)."""
    return launch(_four_ranks, 4, CASES, timeout=60, join_timeout=240)


def _problems(result: dict[str, Any]) -> list[str]:
    bf16 = result["case"].startswith("bf16")
    limits = {"loss": BF16_TOLERANCE if bf16 else FP32_TOLERANCE,
              "grad": float("inf") if bf16 else FP32_TOLERANCE,
              "grad_relative": BF16_TOLERANCE if bf16 else FP32_TOLERANCE,
              "param": BF16_TOLERANCE if bf16 else FP32_TOLERANCE,
              "norm": FP32_TOLERANCE}
    return [f"rank {result['rank']} {result['case']}: {key} differs by {result[key]:.3g} "
            f"(limit {limit:g})" for key, limit in limits.items()
            if result.get(key, 0.0) > limit]


def test_3d_configurations_equal_one_process_after_two_steps(
        per_rank: list[dict[str, Any]]) -> None:
    problems = [problem for outcome in per_rank for result in outcome["results"]
                for problem in _problems(result)]
    assert not problems, "\n".join(problems)
    for outcome in per_rank:
        for result in outcome["results"]:
            case = next(c for c in CASES if c.name == result["case"])
            # the documented path is the one that runs: dp/tp groups come from a DeviceMesh
            assert result["on_device_mesh"], f"{case.name}: groups were not built on a mesh"
            if "gradient_clipping" in case.engine:
                assert result["clipped"], f"{case.name}: the clipping threshold never bit"
            if case.engine.get("zero_stage") == 1:  # ZeRO-1: ≈ 1/dp of the state
                assert 0 < result["state_bytes"] <= (result["unsharded_state_bytes"]
                                                     / result["dp"] + result["bucket_bytes"])
            elif case.model == "mlp" and case.engine.get("precision") is None:
                # reduced once per batch (one bucket per local stage), not per microbatch
                assert result["reduce_calls"] == [result["local_stages"]] * 2, result


def test_3d_setup_errors_name_the_value_and_the_fix(per_rank: list[dict[str, Any]]) -> None:
    for outcome in per_rank:
        world, zero, config = outcome["refusals"]
        assert "world size 4 does not match pipeline_parallel=2 × data_parallel=4" in world
        assert "zero_stage=3" in zero and "overlap_param_gather" in zero and "drop it" in zero
        assert "precision must be one of" in config and "gradient_clipping" in config


def test_fp16_overflow_on_one_rank_makes_every_rank_skip_the_step(
        per_rank: list[dict[str, Any]]) -> None:
    for overflow in (run for outcome in per_rank for run in outcome["overflow"]):  # ZeRO 0, 1
        assert overflow["skipped"] == [True, False]
        assert overflow["unchanged"]  # the skipped step changed no parameter on any rank
        assert overflow["scales"] == [2.0**9, 2.0**9]
        assert overflow["error"] < FP16_TOLERANCE
