"""Memory prediction: the activation peak from the stream order agrees with the simulator's."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from schedules import SCHEDULES, CostModel, ScheduleConfigError, build_schedule, figures, simulate
from schedules.analysis.memory import MemoryModel, predict_memory

__all__: list[str] = []

NAMES = sorted(set(SCHEDULES) - {"forward-only"})


def _schedule(name: str, p: int, m: int):  # type: ignore[no-untyped-def]
    try:
        return build_schedule(name, p, m)
    except ScheduleConfigError:
        assume(False)


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(NAMES), p=st.integers(1, 6), m=st.integers(1, 16),
       data=st.data())
def test_activation_peak_matches_the_simulated_timeline(name: str, p: int, m: int,
                                                        data: st.DataObject) -> None:
    schedule = _schedule(name, p, m)
    num_stages = schedule.num_stages
    saved = data.draw(st.lists(st.integers(0, 1000), min_size=num_stages,
                               max_size=num_stages))
    times = st.floats(0.1, 5.0)
    costs = CostModel(forward=data.draw(times), backward=data.draw(times),
                      weight=data.draw(times), activation_bytes=[float(x) for x in saved])
    simulated = figures(simulate(schedule, costs))
    predicted = predict_memory(schedule, MemoryModel(saved=[float(x) for x in saved]))
    assert [r.activations for r in predicted] == pytest.approx(simulated.peak_activation_bytes)
    counted = predict_memory(schedule, MemoryModel(saved=1.0))
    assert [r.peak_in_flight for r in counted] == list(simulated.peak_activations)


def test_one_f_one_b_rank_k_holds_p_minus_k_microbatches() -> None:
    predicted = predict_memory(build_schedule("1f1b", 4, 8), MemoryModel(saved=10.0))
    assert [r.peak_in_flight for r in predicted] == [4, 3, 2, 1]
    assert [r.activations for r in predicted] == [40.0, 30.0, 20.0, 10.0]


def test_zero_one_shards_the_optimizer_state_and_keeps_reduce_buffers() -> None:
    schedule = build_schedule("interleaved", 2, 4, 2)  # stages 0, 2 on rank 0; 1, 3 on rank 1
    model = MemoryModel(params=[100.0, 200.0, 300.0, 400.0], data_parallel=4, zero_stage=1)
    rank0, rank1 = predict_memory(schedule, model)
    # grads: the parameters' own, the flat reduce buffer, the 1/4 shard; optimizer: Adam's
    # two moments and the fp32 master copy, both of the 1/4 shard
    assert (rank0.params, rank0.gradients, rank0.optimizer) == (400.0, 900.0, 300.0)
    assert (rank1.params, rank1.gradients, rank1.optimizer) == (600.0, 1350.0, 450.0)
    plain = predict_memory(schedule, MemoryModel(params=[100.0, 200.0, 300.0, 400.0],
                                                 data_parallel=4))
    assert plain[0].optimizer == 800.0
    assert rank0.total == 400.0 + 900.0 + 300.0 + rank0.activations


@pytest.mark.parametrize("kwargs, match", [
    ({"params": -1.0}, "params"), ({"saved": [1.0, 2.0]}, "2 values"),
    ({"data_parallel": 0}, "data_parallel"), ({"zero_stage": 2}, "zero_stage"),
    ({"optimizer_factor": float("nan")}, "optimizer_factor")])
def test_bad_models_are_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ScheduleConfigError, match=match):
        predict_memory(build_schedule("1f1b", 4, 4), MemoryModel(**kwargs))  # type: ignore[arg-type]
