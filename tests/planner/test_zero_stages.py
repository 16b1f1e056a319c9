"""ZeRO-2/3 in `pipesched plan`: their model-state bytes, their per-microbatch collectives,
and a pick that needs ZeRO-3 to fit, with its reason and its command lines."""

from __future__ import annotations

import numpy as np
import pytest

import pipeline.planner.memory as memory
from pipeline.cli import main
from pipeline.planner import PRESETS, peak_rank_memory
from pipeline.planner.data_parallel import sharded_comm_seconds
from pipeline.planner.pricing import allgather_seconds, reduce_scatter_seconds
from schedules.analysis.accounting import model_state_bytes

__all__: list[str] = []

A100 = PRESETS["a100-80g"]
# ~22B parameters: 16 bytes each do not fit on 8 A100-80G at pp = tp = 1 below ZeRO-3
# (ZeRO-1 8 + 8/8 = 9, ZeRO-2 4 + 12/8 = 5.5, ZeRO-3 16/8 = 2 bytes per parameter)
BIG = ["--model", "layers=48,hidden=6144,heads=48,vocab=32000,seq=512",
       "--cluster", "a100-80g", "--global-batch", "8", "--pp", "1", "--tp", "1"]


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_rank_memory_holds_the_stages_bytes_per_parameter(zero: int) -> None:
    # from the definition (fp32 Adam, d = 8): parameters 4, gradients 4, optimizer 8 bytes,
    # ZeRO-1 shards the optimizer's, ZeRO-2 also the gradients, ZeRO-3 also the parameters
    params, d = 1e9, 8
    expected = (4 / (d if zero >= 3 else 1), 4 / (d if zero >= 2 else 1),
                8 / (d if zero >= 1 else 1))
    got, _ = peak_rank_memory([params], [0.0], [0.0], [0], dp=d, zero=zero, recompute=False)
    assert (got.parameters, got.gradients, got.optimizer) == pytest.approx(
        tuple(params * x for x in expected))
    assert got.total == pytest.approx(params * model_state_bytes(
        "fp32", zero_stage=zero, data_parallel=d).total)


def test_zero_2_and_3_collectives_from_their_definition() -> None:
    # two stages on ranks 0, 1 (3 and 5 layers), m = 4, d = 4, fp32 gradients; per layer
    # r: its reduce-scatter, g: its all-gather
    params, layers, m, d = np.array([3e8, 5e8]), [3, 5], 4, 4
    rs = [reduce_scatter_seconds(x / n * 4.0, d, 1, A100) for x, n in zip(params, layers)]
    ag = [allgather_seconds(x / n * 4.0, d, 1, A100) for x, n in zip(params, layers)]

    def priced(zero: int, compute: float) -> np.ndarray:
        work = np.full(2, compute)
        return sharded_comm_seconds(params, layers, [0, 1], A100, dp=d, tp=1, zero_stage=zero,
                                    num_microbatches=m, grad_reduce_bytes=4.0,
                                    forward=work, backward=2 * work)
    assert priced(0, 0).tolist() == priced(1, 0).tolist() == [0.0, 0.0]
    # no compute hides anything: every collective in turn on the link, but for the last
    # backward's two reductions still in flight at the step (the simulator's)
    assert priced(2, 0.0) == pytest.approx([(m * n - 2) * r for r, n in zip(rs, layers)])
    assert priced(3, 0.0) == pytest.approx([(m * n - 2) * r + 2 * m * n * g
                                            for r, g, n in zip(rs, ag, layers)])
    # compute ahead of the link: the reductions hide behind the backward, each gather
    # behind the previous layer (prefetch) but the first of each forward and backward
    assert priced(2, 100.0).tolist() == [0.0, 0.0]
    assert priced(3, 100.0) == pytest.approx([2 * m * g for g in ag])
    assert sharded_comm_seconds(params, layers, [0, 1], A100, dp=1, tp=1, zero_stage=3,
                                num_microbatches=m, grad_reduce_bytes=4.0,
                                forward=np.ones(2), backward=np.ones(2)).tolist() == [0, 0]


def test_states_that_fit_only_at_zero_3_pick_z3_and_say_why(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *BIG, "--zero", "0,1,2,3"]) == 0
    out = capsys.readouterr().out
    pick = next(line for line in out.splitlines() if line.startswith("pick: "))
    assert pick.startswith("pick: pp1 tp1 dp8 1f1b") and " z3" in pick
    assert "why z3: memory: no configuration at ZeRO 0-2 both fits in 79.3 GiB" in out
    assert "zero_stage=3" in out and "--zero-stage 3" in out
    # below ZeRO-3 nothing fits, and the refusal names the stages that would
    assert main(["plan", *BIG, "--zero", "0,1,2"]) == 2
    assert "does not fit" in capsys.readouterr().err
    assert main(["plan", *BIG]) == 2  # the default searches ZeRO 0 and 1 only
    assert "allow ZeRO-2/3 (--zero 0,1,2,3" in capsys.readouterr().err
    assert main(["plan", *BIG, "--fsdp"]) == 0  # fully sharded = ZeRO-3
    assert " z3" in next(line for line in capsys.readouterr().out.splitlines()
                         if line.startswith("pick: "))


def test_zero_3_priced_with_zero_1_bytes_fails_the_pick(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # planted bug: ZeRO-2/3 priced with ZeRO-1's model-state bytes
    monkeypatch.setattr(memory, "_state_bytes", lambda zero, dp: model_state_bytes(
        "fp32", zero_stage=min(zero, 1), data_parallel=dp))
    code = main(["plan", *BIG, "--zero", "0,1,2,3"])
    out = capsys.readouterr().out
    assert code == 2 and "why z3" not in out


def test_zero_3_costs_time_where_zero_1_fits(capsys: pytest.CaptureFixture[str]) -> None:
    # a small model: every stage fits; ZeRO-3's gathers make it slower than ZeRO-1
    small = ["--model", "layers=8,hidden=1024,heads=16,vocab=32000,seq=512",
             "--cluster", "a100-80g", "--global-batch", "32", "--pp", "2", "--tp", "1",
             "--microbatch-size", "2", "--schedules", "1f1b", "--no-recompute"]
    times = {}
    for zero in (1, 2, 3):
        assert main(["plan", *small, "--zero", str(zero)]) == 0
        line = next(line for line in capsys.readouterr().out.splitlines()
                    if line.startswith("  1 "))
        value, unit = line.split()[8:10]
        times[zero] = float(value) * {"s": 1.0, "ms": 1e-3}[unit]
    # ZeRO-2's per-backward reductions hide behind the backwards here (the engine's rule,
    # `schedules.analysis.zero_exposure`); ZeRO-3's first gather of each F and B cannot
    assert times[1] <= times[2] < times[3]
