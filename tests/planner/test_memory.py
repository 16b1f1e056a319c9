"""The memory model: schedule peaks, ZeRO-1 sharding, recomputation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.planner import HeldTrace, LayerProfile, held_peaks, peak_rank_memory
from pipeline.planner.memory import stage_activation_bytes
from schedules import SCHEDULES, CostModel, figures, generate_schedule, simulate

__all__: list[str] = []

TRAINING = sorted(name for name in SCHEDULES if name not in ("forward-only", "zb-auto"))


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(TRAINING), st.integers(1, 6), st.integers(1, 12), st.integers(1, 3))
def test_held_peaks_match_the_simulators_count(name: str, p: int, m: int, v: int) -> None:
    low, high = SCHEDULES[name].chunks
    chunks = min(max(v, low), high) if high is not None else max(v, low)
    try:
        schedule = generate_schedule(name, p, m, chunks)
    except ValueError:
        return  # the schedule refuses these sizes; the planner counts them as refused
    simulated = figures(simulate(schedule, CostModel(forward=1.3, backward=0.7, weight=2.1)))
    assert held_peaks(schedule) == simulated.peak_activations


@pytest.mark.parametrize(("p", "m"), [(4, 8), (4, 2), (8, 16)])
def test_rank_zero_of_1f1b_holds_the_most(p: int, m: int) -> None:
    peaks = held_peaks(generate_schedule("1f1b", p, m))
    assert peaks == tuple(min(p - rank, m) for rank in range(p))


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(TRAINING), st.integers(2, 5), st.integers(1, 10),
       st.lists(st.floats(0, 1e6), min_size=12, max_size=12))
def test_peak_bytes_lie_between_one_stage_and_the_count_at_the_largest(
        name: str, p: int, m: int, sizes: list[float]) -> None:
    try:
        schedule = generate_schedule(name, p, m)
    except ValueError:
        return
    trace = HeldTrace.of(schedule)
    stage_bytes = sizes[:schedule.num_stages] + [0.0] * (schedule.num_stages - len(sizes))
    peaks = trace.peak_bytes(stage_bytes)
    for rank, count in enumerate(trace.peaks()):
        mine = [stage_bytes[s] for s in schedule.stages_of(rank)]
        assert max(mine) - 1e-6 <= peaks[rank] <= count * max(mine) + 1e-6
    uniform = trace.peak_bytes([3.0] * schedule.num_stages)
    assert uniform.tolist() == [3.0 * count for count in trace.peaks()]


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 64), st.floats(1, 1e9), st.floats(0, 1e9))
def test_zero1_shards_the_optimizer_state_as_megatron_does(dp: int, params: float,
                                                           held: float) -> None:
    plain, _ = peak_rank_memory([params], [held], [0.0], [0], dp=dp, zero=0, recompute=False)
    sharded, _ = peak_rank_memory([params], [held], [0.0], [0], dp=dp, zero=1,
                                  recompute=False)
    assert sharded.parameters == plain.parameters == 4 * params
    assert plain.gradients == 4 * params
    # Megatron's distributed optimizer: one gradient buffer; Adam's moments of a 1/dp shard
    # whose fp32 master is a view of the parameters (8 + 8/dp bytes per parameter)
    assert sharded.gradients == plain.gradients
    assert plain.optimizer == 8 * params
    assert sharded.optimizer == pytest.approx(8 * params / dp)
    assert sharded.activations == plain.activations == held


def test_recomputation_keeps_only_layer_inputs() -> None:
    layers = [LayerProfile(name=f"l{i}", held_replicated=100.0, input_bytes=10.0)
              for i in range(4)]
    assert stage_activation_bytes(layers, 1, 2, recompute=False) == 2 * 4 * 100
    assert stage_activation_bytes(layers, 1, 2, recompute=True) == 2 * 4 * 10
    memory, _ = peak_rank_memory([0.0], [240.0], [200.0], [0], dp=1, zero=0, recompute=True)
    assert memory.activations == 240 + 200  # plus one layer's workspace


def test_the_largest_rank_is_reported() -> None:
    memory, rank = peak_rank_memory([10.0, 10.0], [10.0, 5.0], [0.0, 0.0], [0, 1],
                                    dp=1, zero=0, recompute=False)
    assert rank == 0 and memory.activations == 10.0


def test_a_step_only_peak_is_the_larger_of_the_two_peaks() -> None:
    # Oracle from the definition: through the schedule a rank holds 16 B/param of states
    # plus the extras plus its activations; at the optimizer step it holds the states, the
    # extras and the step's bytes, and no activations; its peak is the larger.
    params, held = [10.0, 20.0], [300.0, 50.0]
    extra, step = 2.0, 6.0
    during = [p * (16 + extra) + h for p, h in zip(params, held, strict=True)]
    at_step = [p * (16 + extra + step) for p in params]
    peaks = [max(d, s) for d, s in zip(during, at_step, strict=True)]
    memory, rank = peak_rank_memory(params, held, [0.0, 0.0], [0, 1], dp=1, zero=0,
                                    recompute=False, extra_gradient_bytes=extra,
                                    step_gradient_bytes=step)
    assert rank == peaks.index(max(peaks)) == 0 and memory.total == max(peaks)
    assert memory.activations == 300.0 and memory.gradients == 10 * (4 + extra)
    # more parameters on rank 1: its step peak (no activations) is now the largest
    memory, rank = peak_rank_memory([10.0, 40.0], held, [0.0, 0.0], [0, 1], dp=1, zero=0,
                                    recompute=False, extra_gradient_bytes=extra,
                                    step_gradient_bytes=step)
    assert rank == 1 and memory.activations == 0.0
    assert memory.gradients == 40 * (4 + extra + step)
    assert memory.total == 40 * (16 + extra + step)
