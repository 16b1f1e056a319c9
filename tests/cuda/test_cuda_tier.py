"""The engine on a GPU equals the single-process CPU reference: every schedule at pp = 2, the
3D configurations (tp, ZeRO-1, bf16 half parameters, fp16 loss scaling), a checkpoint saved on
the GPU and loaded on the CPU and back, greedy generation, and the allocator's bytes against
the counted model states.

Ranks share the machine's GPU(s) as `launch` places them: two or four ranks on one GPU go
through the staged gloo path, a GPU each through nccl. Without CUDA every test skips unless
PIPESCHED_DEVICE_TIER=cpu rehearses the tier on CPU ranks through the staged backend.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline import launch
from tests.support.device_tier import (
    DEVICE_CASES,
    checkpoint_round_trip,
    generate_on_device,
    memory_against_accounting,
    planted_unwaited_receive,
    schedule_errors,
    three_d_results,
    tier_launch_options,
)

pytestmark = [pytest.mark.cuda, pytest.mark.multiprocess]

DEVICE_TOLERANCE = 1e-4
"""fp32 on a GPU against fp32 on a CPU: other kernels, other summation orders (TF32 is off
by default for matmuls in torch)."""
HALF_TOLERANCE = {"bf16": 2e-2, "fp16": 5e-3}
"""As the CPU tests state them (tests/parallel/test_engine3d_equivalence.py)."""


def test_every_schedule_on_the_device_equals_the_cpu_reference() -> None:
    for rank, found in enumerate(launch(schedule_errors, 2, timeout=120, join_timeout=540,
                                        **tier_launch_options())):
        problems = [f"rank {rank} {name}: {key} differs by {value:.3g}"
                    for name, errors in found.items() for key, value in errors.items()
                    if value > DEVICE_TOLERANCE]
        assert not problems, "\n".join(problems)


def test_a_receive_used_without_waiting_is_caught() -> None:
    """The planted CUDA bug of a receive read on the compute stream before its data is
    there: the equivalence above must not pass with it."""
    outcomes = launch(planted_unwaited_receive, 2, timeout=60, join_timeout=300,
                      **tier_launch_options())
    # caught by the equivalence check itself, not by a timeout or a broken run
    assert all(isinstance(outcome, dict) for outcome in outcomes), outcomes
    assert any(max(outcome.values()) > DEVICE_TOLERANCE for outcome in outcomes), outcomes


def test_3d_configurations_on_the_device_equal_the_cpu_reference() -> None:
    for results in launch(three_d_results, 4, timeout=120, join_timeout=540,
                          **tier_launch_options()):
        for result, case in zip(results, DEVICE_CASES):
            precision = case.engine.get("precision")
            tolerance = HALF_TOLERANCE.get(precision, DEVICE_TOLERANCE)
            assert result["loss"] <= tolerance, result
            assert result["param"] <= tolerance, result
            assert result["grad_relative"] <= tolerance, result


def test_checkpoint_saved_on_the_device_resumes_on_the_cpu_and_back(tmp_path: Path) -> None:
    for run in launch(checkpoint_round_trip, 4, str(tmp_path), timeout=120, join_timeout=300,
                      **tier_launch_options()):
        for straight, resumed in ((run["straight"], run["on_cpu"]),
                                  (run["straight"], run["back_on_device"])):
            assert resumed == pytest.approx(straight, rel=DEVICE_TOLERANCE), run


def test_greedy_generation_on_the_device_equals_hf_on_the_cpu() -> None:
    pytest.importorskip("transformers")
    for tokens in launch(generate_on_device, 2, "llama", timeout=120, join_timeout=300,
                         **tier_launch_options()):
        assert tokens["ours"] == tokens["hf"]


def test_allocator_bytes_match_the_counted_model_states() -> None:
    for rows in launch(memory_against_accounting, 4, timeout=120, join_timeout=300,
                       **tier_launch_options()):
        for row in rows:
            assert row["counted"] > 0, row
            if row["allocated"] is None:  # a CPU has no allocator counter: counted only
                continue
            # the counted states are all held, plus at most the loss, the batch and the
            # allocator's 512-byte rounding: within 2 % (these layers hold 2-12 MiB)
            assert row["counted"] <= row["allocated"] <= row["counted"] * 1.02, row
