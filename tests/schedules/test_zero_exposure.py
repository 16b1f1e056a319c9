"""The ZeRO-2 / 3 exposure rule (`schedules.analysis.zero_exposure`) against sums written from its
definition: all hidden, all exposed, one gather per op hidden by prefetch; its periodic
shortcut against the walk of every microbatch."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schedules.analysis.zero_exposure import ZeroLayerCosts, zero_exposed
from schedules.ir.errors import ScheduleConfigError

F, W, I, G, R = 10.0, 10.0, 10.0, 3.0, 2.0  # noqa: E741 (I: the input gradient)


def _layers(count: int, *, first_input: float = I, gather: float = G, reduce: float = R,
            compute: float = 1.0) -> list[ZeroLayerCosts]:
    return [ZeroLayerCosts(F * compute, W * compute,
                           (first_input if u == 0 else I) * compute, gather, reduce)
            for u in range(count)]


@pytest.mark.parametrize("m", [1, 2, 7])
def test_sums_from_the_definition(m: int) -> None:
    L = 3
    layers = _layers(L)
    # no prefetch: every gather waited whole, before each F and B of each layer; each
    # reduction hides behind the layer's input gradient (R < I)
    assert zero_exposed(layers, zero_stage=3, microbatches=m, prefetch=False).total \
        == pytest.approx(2 * m * L * G)
    # prefetch: only the first gather of each F and each B (G < F, G < W + I)
    assert zero_exposed(layers, zero_stage=3, microbatches=m).total == pytest.approx(2 * m * G)
    # kept after the forward: the first microbatch's forward gathers, nothing after
    assert zero_exposed(layers, zero_stage=3, microbatches=m,
                        reshard_after_forward=False).total == pytest.approx(G)
    assert zero_exposed(layers, zero_stage=3, microbatches=m, reshard_after_forward=False,
                        prefetch=False).total == pytest.approx(L * G)
    # ZeRO-2: the reductions hide; the first layer's (no input gradient after it) is
    # waited for at the step, before the step's parameter gathers
    got = zero_exposed(_layers(L, first_input=0.0), zero_stage=2, microbatches=m,
                       step_gather=[G] * L)
    assert (got.forward, got.backward, got.step) == pytest.approx((0.0, 0.0, R + L * G))


@pytest.mark.parametrize("zero", [2, 3])
def test_without_compute_every_collective_is_exposed_in_turn(zero: int) -> None:
    L, m = 3, 4
    got = zero_exposed(_layers(L, compute=0.0), zero_stage=zero, microbatches=m)
    assert got.total == pytest.approx(m * L * R + (2 * m * L * G if zero == 3 else 0.0))
    assert got.step == pytest.approx(2 * R)  # the window's two last reductions


@given(st.integers(1, 4), st.integers(1, 9), st.booleans(), st.booleans(),
       st.floats(0, 30), st.floats(0, 30), st.integers(2, 3))
def test_the_periodic_shortcut_is_the_walk(layers: int, m: int, prefetch: bool, reshard: bool,
                                           gather: float, reduce: float, zero: int) -> None:
    costs = _layers(layers, first_input=0.0, gather=gather, reduce=reduce)
    options = {"zero_stage": zero, "prefetch": prefetch, "reshard_after_forward": reshard}
    shortcut = zero_exposed(costs, microbatches=m, **options)  # type: ignore[arg-type]
    walked = zero_exposed(costs, microbatches=m, shortcut=False, **options)  # type: ignore[arg-type]
    assert shortcut.total == pytest.approx(walked.total, rel=1e-9, abs=1e-9)
    assert shortcut.step == pytest.approx(walked.step, rel=1e-9, abs=1e-9)


def test_bad_input_is_refused_by_name() -> None:
    with pytest.raises(ScheduleConfigError, match=r"ZeroLayerCosts\.gather must be a finite"):
        ZeroLayerCosts(1.0, 1.0, 1.0, -1.0, 1.0)
    with pytest.raises(ScheduleConfigError, match="zero_stage must be 2 or 3"):
        zero_exposed(_layers(1), zero_stage=1, microbatches=1)
    with pytest.raises(ScheduleConfigError, match="microbatches must be an int >= 1"):
        zero_exposed(_layers(1), zero_stage=2, microbatches=0)
