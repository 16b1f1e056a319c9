"""The one memory accounting (`schedules.analysis.accounting`) against its definitions:
Megatron-Core's bytes per parameter, Korthikanti et al.'s activation bytes per layer, and a
brute-force count of what a rank holds under a schedule."""

from __future__ import annotations

import pytest

from schedules import build_schedule, figures, simulate
from schedules.analysis.accounting import (
    HeldTrace,
    layer_activation_bytes,
    model_state_bytes,
    stage_activation_bytes,
    stream_peak,
)
from schedules.ir.errors import ScheduleConfigError
from schedules.ir.instructions import Kind
from schedules.search.candidates import peak_in_flight


@pytest.mark.parametrize("d", [1, 2, 4])
def test_model_states_are_megatrons_figures(d: int) -> None:
    # Megatron-Core's distributed-optimizer table: without -> with ZeRO-1
    expected = {"fp32": (16, 8 + 8 / d), "bf16": (18, 6 + 12 / d), "fp16": (20, 4 + 16 / d)}
    for precision, (plain, sharded) in expected.items():
        assert model_state_bytes(precision, data_parallel=d).total == plain  # type: ignore[arg-type]
        assert model_state_bytes(precision, zero_stage=1,  # type: ignore[arg-type]
                                 data_parallel=d).total == pytest.approx(sharded)
    assert model_state_bytes("fp32", optimizer_factor=0).total == 8  # plain SGD


@pytest.mark.parametrize("d", [1, 2, 8])
def test_zero_stages_are_the_zero_papers_formulas(d: int) -> None:
    # Rajbhandari et al. 2020, Figure 1 (mixed-precision Adam, K = 12): baseline (2 + 2 + K),
    # P_os 2 + 2 + K/d, P_os+g 2 + (2 + K)/d, P_os+g+p (2 + 2 + K)/d, each part by its stage.
    # Ours counts fp32 main gradients for bf16 under ZeRO-0 / 1 (4, not the paper's 2) and
    # fp32 has (4, 4, 8); ZeRO-2 / 3 keep half gradient shards (the paper's 2 + 14/d) and
    # ZeRO-3 no half weights between uses (14/d, under the paper's 16/d).
    for (params, grads, optimizer), precision in (((4, 4, 8), "fp32"), ((2, 4, 12), "bf16")):
        expected = {0: params + grads + optimizer, 1: params + grads + optimizer / d,
                    2: params + (grads + optimizer) / d, 3: (params + grads + optimizer) / d}
        if precision == "bf16":
            expected |= {2: 2 + 14 / d, 3: 14 / d}
        for stage, total in expected.items():
            got = model_state_bytes(precision, zero_stage=stage,  # type: ignore[arg-type]
                                    data_parallel=d)
            assert got.total == pytest.approx(total), (precision, stage)
    assert model_state_bytes("fp32", zero_stage=3, data_parallel=4).total == 4  # 16Ψ / 4
    for precision in ("bf16", "fp16"):  # DeepSpeed's mixed-precision figures, or under
        assert model_state_bytes(precision, zero_stage=2, data_parallel=d).total == 2 + 14 / d
        assert model_state_bytes(precision, zero_stage=3, data_parallel=d).total <= 16 / d
    for bad in (4, -1, True):
        with pytest.raises(ScheduleConfigError, match="zero_stage"):
            model_state_bytes("fp32", zero_stage=bad)


def test_layer_activations_are_korthikantis_table() -> None:
    s, b, h, a, t = 128, 2, 64, 4, 2
    sbh = s * b * h
    assert layer_activation_bytes(s, b, h, a) == sbh * (34 + 5 * a * s / h)
    # fused: no s × s scores; the kernel's fp32 log-sum-exp per row and head instead
    assert layer_activation_bytes(s, b, h, a, attention="fused") == 34 * sbh + 4 * a * s * b
    # no dropout: two sbh masks and one as²b mask fewer
    assert layer_activation_bytes(s, b, h, a, dropout_mask_bytes=0) == \
        sbh * (32 + 4 * a * s / h)
    assert layer_activation_bytes(s, b, h, a, recompute="selective") == 34 * sbh
    assert layer_activation_bytes(s, b, h, a, recompute="full") == 2 * sbh
    assert layer_activation_bytes(s, b, h, a, t=t) == sbh * (10 + 24 / t + 5 * a * s / (h * t))
    assert layer_activation_bytes(s, b, h, a, t=t, sequence_parallel=True) == \
        sbh * (34 + 5 * a * s / h) / t
    assert layer_activation_bytes(s, b, h, a, recompute="full", t=t,
                                  sequence_parallel=True) == sbh
    # ffn f and K/V width k: attention 7sh + 4sk, MLP 3sh + 4sf, norms 4sh (+ scores)
    f, k = 3 * h, h // 2
    assert layer_activation_bytes(s, b, h, a, ffn=f, kv_width=k, attention="fused") == \
        b * (14 * s * h + 4 * s * k + 4 * s * f) + 4 * a * s * b
    assert stage_activation_bytes([5.0] * 4, [1.0] * 4, 3) == 3 * 1 + 5
    for bad in ({"attention": "flash"}, {"recompute": "partial"}, {"t": 0}):
        with pytest.raises(ScheduleConfigError):
            layer_activation_bytes(s, b, h, a, **bad)  # type: ignore[arg-type]


def _brute_force(stream: list[tuple[Kind, int, int]], saved: list[float], output: list[float],
                 sends: list[bool], free: bool) -> float:
    """Oracle: replay the definition with an explicit set of live buffers."""
    live: dict[tuple[str, int, int], float] = {}
    peak = 0.0
    for kind, stage, i in stream:
        if kind is Kind.F:
            live[("saved", stage, i)] = saved[stage]
            live[("output", stage, i)] = output[stage]
            peak = max(peak, sum(live.values()))
            if free and sends[stage]:
                del live[("output", stage, i)]
        elif kind in (Kind.B, Kind.OVERLAP_B, Kind.W):
            live.pop(("saved", stage, i))
            live.pop(("output", stage, i), None)
    return peak


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"])
def test_stream_peak_equals_the_brute_force_count(name: str) -> None:
    schedule = build_schedule(name, 4, 8)
    stages = schedule.num_stages
    saved = [3.0 + st for st in range(stages)]
    output = [1.0 + 0.5 * st for st in range(stages)]
    sends = [st < stages - 1 for st in range(stages)]
    counts = []
    for stream in schedule.streams:
        ops = [(op.kind, op.stage, op.microbatch) for op in stream]
        for free in (False, True):
            got = stream_peak(ops, saved, output, sends=sends, free_sent_outputs=free)
            assert got.bytes == _brute_force(ops, saved, output, sends, free)
        counts.append(stream_peak(ops, [1.0] * stages).count)
    assert tuple(counts) == figures(simulate(schedule)).peak_activations
    # the planner's vectorised trace is the same count
    assert HeldTrace.of(schedule).peak_bytes(saved).tolist() == [
        stream_peak([(op.kind, op.stage, op.microbatch) for op in stream], saved).bytes
        for stream in schedule.streams]
    assert peak_in_flight(schedule.streams) == max(counts)
