"""V-Min and V-Half: valid, within their building block's memory, and the trade-off holds."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedules import (
    CostModel,
    build_schedule,
    figures,
    generate_schedule,
    one_f_one_b,
    simulate,
    v_half,
    v_min,
    validate,
    zb_v,
)
from schedules.generators.controllable_memory import building_block


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 12), m=st.integers(1, 40))
def test_valid_and_within_the_building_blocks_memory(p: int, m: int) -> None:
    # In chunk activations (a chunk is half a rank's share): V-Min holds about a third of
    # 1F1B's 2p, V-Half about half, each plus a constant from the block's ends.
    for make, bound in ((v_min, math.ceil(2 * p / 3) + 2), (v_half, p + 2)):
        schedule = make(p, m)
        validate(schedule)
        assert max(figures(simulate(schedule)).peak_activations) <= bound


def test_build_lowers_and_validates() -> None:
    for name in ("v-min", "v-half"):
        validate(build_schedule(name, 4, 9))


@pytest.mark.parametrize("p", [3, 4, 6, 8, 12, 16])
def test_the_memory_bubble_trade_off_of_the_paper(p: int) -> None:
    # Qi et al. 2024, Table 1 / Fig. 5: memory V-Min < V-Half < V-ZB (= ZB-V, 1F1B's) and
    # time the other way round, all faster than 1F1B; unit costs per rank share.
    m = 4 * p
    rows = []
    for schedule in (v_min(p, m), v_half(p, m), zb_v(p, m), one_f_one_b(p, m)):
        v = schedule.chunks
        result = figures(simulate(schedule, CostModel(forward=1 / v, backward=1 / v,
                                                      weight=1 / v)))
        rows.append((result.makespan, max(result.peak_activations) / v))
    (t_min, mem_min), (t_half, mem_half), (t_zb, mem_zb), (t_1f1b, mem_1f1b) = rows
    assert mem_min <= mem_half <= mem_zb == mem_1f1b == p
    assert t_zb <= t_half <= t_min < t_1f1b
    if p >= 6:
        assert mem_min < mem_half < mem_zb


def test_blocks_put_a_ranks_four_ops_on_distinct_slots() -> None:
    for p in range(1, 17):
        for variant in ("min", "half"):
            for slots in building_block(p, variant):
                assert len({slot % 6 for slot in slots}) == 4


GOLDEN = {
    "v-min": "rank 0: 0F0 3F0 3I0 3W0 0F1 0I0 0W0 3F1 3I1 3W1 0I1 0W1\n"
             "rank 1: 1F0 2F0 2I0 1I0 1F1 2F1 2W0 1W0 2I1 1I1 2W1 1W1",
    "v-half": "rank 0: 0F0 0F1 3F0 3I0 3W0 3F1 0I0 3I1 0W0 3W1 0I1 0W1\n"
              "rank 1: 1F0 2F0 1F1 2F1 2I0 1I0 2W0 1W0 2I1 1I1 2W1 1W1",
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_streams_at_p2_m2(name: str) -> None:
    assert generate_schedule(name, 2, 2).format() == GOLDEN[name]
