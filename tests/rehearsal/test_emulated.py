"""Emulated layers: F, I and W each wait their own time (on a fake clock), saved bytes counted."""

from __future__ import annotations

import pytest
import torch

from pipeline import PipelineConfigError
from pipeline.rehearsal.emulated import (
    EmulatedCost,
    EmulatedLayer,
    WallClock,
    emulated_layers,
    emulated_loss,
)
from pipeline.runtime.saved_memory import SavedTensorMeter
from pipeline.runtime.split_backward import LayerGrads

__all__: list[str] = []


class FakeClock:
    """Time moves only when a layer sleeps; every sleep is recorded as (op, seconds)."""

    def __init__(self) -> None:
        self.time = 0.0
        self.sleeps: list[tuple[str, float]] = []

    def now(self) -> float:
        return self.time

    def sleep_until(self, deadline: float, label: str) -> None:
        self.sleeps.append((label, round(deadline - self.time, 9)))
        self.time = max(self.time, deadline)

    def take(self) -> list[tuple[str, float]]:
        sleeps, self.sleeps = self.sleeps, []
        return sleeps


def _stack(clock: FakeClock, n: int = 3) -> list[EmulatedLayer]:
    return [EmulatedLayer(EmulatedCost(forward=1.0 + k, input_grad=10.0 + k,
                                       weight_grad=100.0 + k, output_elements=3 + k,
                                       param_elements=5), clock) for k in range(n)]


def _forward(layers: list[EmulatedLayer], x: torch.Tensor) -> tuple[torch.Tensor, LayerGrads]:
    captured = LayerGrads()
    for layer in layers:
        x = layer(x)
        captured.watch(layer, x)
    return x, captured


def test_forward_waits_each_layers_forward_time_and_outputs_its_shape() -> None:
    clock = FakeClock()
    out, _ = _forward(_stack(clock), torch.zeros(2, 7, requires_grad=True))
    assert clock.take() == [("F", 1.0), ("F", 2.0), ("F", 3.0)]
    assert out.shape == (2, 5)


def test_split_backward_pays_input_grad_in_i_and_weight_grad_in_w_only() -> None:
    clock = FakeClock()
    layers = _stack(clock)
    x = torch.zeros(2, 7, requires_grad=True)
    out, captured = _forward(layers, x)
    clock.take()
    # I as the interpreter runs it: gradients of the stage input only, graph kept for W
    torch.autograd.backward([emulated_loss(out, None)], inputs=[x], retain_graph=True)
    assert clock.take() == [("I", 12.0), ("I", 11.0), ("I", 10.0)]
    assert x.grad is not None and x.grad.shape == x.shape
    assert all(layer.weight.grad is None for layer in layers)
    assert captured.complete()
    captured.backward_weights()  # W
    assert clock.take() == [("W", 102.0), ("W", 101.0), ("W", 100.0)]
    assert all(layer.weight.grad is not None and layer.weight.grad.shape == (5,)
               for layer in layers)


def test_full_backward_pays_input_and_weight_grad() -> None:
    clock = FakeClock()
    x = torch.zeros(1, 4, requires_grad=True)
    out, _ = _forward(_stack(clock, 2), x)
    clock.take()
    emulated_loss(out, None).backward()
    assert sorted(clock.take()) == [("I", 10.0), ("I", 11.0), ("W", 100.0), ("W", 101.0)]


def test_first_layer_input_is_data_so_its_input_grad_never_runs() -> None:
    clock = FakeClock()
    out, _ = _forward(_stack(clock, 2), torch.zeros(1, 4))  # no grad on the data
    clock.take()
    emulated_loss(out, None).backward()
    assert sorted(clock.take()) == [("I", 11.0), ("W", 100.0), ("W", 101.0)]


def test_no_grad_forward_waits_forward_only() -> None:
    clock = FakeClock()
    with torch.no_grad():
        _forward(_stack(clock, 2), torch.zeros(1, 4))
    assert clock.take() == [("F", 1.0), ("F", 2.0)]


def test_saved_bytes_are_each_layers_output_until_the_backward_frees_them() -> None:
    clock = FakeClock()
    layers = _stack(clock)
    meter = SavedTensorMeter(ignore=[p for layer in layers for p in layer.parameters()])
    x = torch.zeros(2, 7, requires_grad=True)
    with meter:
        out, _ = _forward(layers, x)
    assert meter.live == 4 * 2 * (3 + 4 + 5)
    emulated_loss(out, None).backward()
    del out
    assert meter.live == 0
    assert meter.peak == 4 * 2 * (3 + 4 + 5)


@pytest.mark.parametrize("field, value", [("forward", -1.0), ("input_grad", float("nan")),
                                          ("weight_grad", float("inf")), ("forward", "1"),
                                          ("output_elements", 0), ("param_elements", 1.5)])
def test_bad_costs_are_refused_naming_the_field(field: str, value: object) -> None:
    values: dict[str, object] = {"forward": 0.0, "input_grad": 0.0, "weight_grad": 0.0}
    values[field] = value
    with pytest.raises(PipelineConfigError, match=field):
        EmulatedCost(**values)  # type: ignore[arg-type]


def test_layer_specs_build_only_when_asked() -> None:
    specs = emulated_layers([EmulatedCost(forward=0.0, input_grad=0.0, weight_grad=0.0)] * 2)
    assert len(specs) == 2 and isinstance(specs[0].build(), EmulatedLayer)
    with pytest.raises(PipelineConfigError, match="at least one"):
        emulated_layers([])


def test_first_stage_i_runs_the_input_chain_so_w_pays_weights_only() -> None:
    # regression: on the first stage (no input to differentiate) I did nothing and W ran
    # the whole input-gradient chain, so I cost 0 and W cost I + W there
    clock = FakeClock()
    out, captured = _forward(_stack(clock), torch.zeros(2, 7))  # data: no grad
    clock.take()
    captured.backward_inputs([emulated_loss(out, None)], None)
    assert clock.take() == [("I", 12.0), ("I", 11.0)]  # the first layer's I never runs
    assert captured.complete()
    captured.backward_weights()
    assert clock.take() == [("W", 102.0), ("W", 101.0), ("W", 100.0)]


class _LateSleeper:
    """A fake `time`: sleeping wakes `late` seconds after asked; nothing else moves it."""

    def __init__(self, late: float) -> None:
        self.time, self.late = 0.0, late
        self.asked: list[float] = []

    def now(self) -> float:
        return self.time

    def sleep(self, seconds: float) -> None:
        self.asked.append(round(seconds, 9))
        self.time += seconds + self.late


def test_wall_clock_repays_an_overshoot_on_the_next_back_to_back_wait() -> None:
    fake = _LateSleeper(late=0.3)
    clock = WallClock(spin_limit=0.0, now=fake.now, sleep=fake.sleep)
    clock.lateness = 0.0
    clock.sleep_until(clock.now() + 1.0, "F")  # asks 1.0, wakes at 1.3: 0.3 owed
    assert clock.debt == pytest.approx(0.3)
    clock.sleep_until(clock.now() + 1.0, "F")  # issued at once: starts at 1.0, ends at 2.0
    assert fake.asked == [1.0, pytest.approx(0.7)]


def test_wall_clock_hides_the_host_work_between_back_to_back_waits() -> None:
    # regression: a backward's 8 waits took 8.76 ms for 8 ms, the autograd engine's ~0.1 ms
    # between nodes added to each (a device runs the next queued kernel meanwhile)
    fake = _LateSleeper(late=0.0)
    clock = WallClock(spin_limit=0.0, carry_window=0.2, now=fake.now, sleep=fake.sleep)
    clock.lateness = 0.0
    clock.sleep_until(clock.now() + 1.0, "I")
    fake.time += 0.1  # host work between the two nodes, shorter than the window
    clock.sleep_until(clock.now() + 1.0, "W")
    assert fake.time == pytest.approx(2.0)


def test_wall_clock_forgives_the_debt_after_a_pause() -> None:
    fake = _LateSleeper(late=0.3)
    clock = WallClock(spin_limit=0.0, carry_window=0.1, now=fake.now, sleep=fake.sleep)
    clock.lateness = 0.0
    clock.sleep_until(clock.now() + 1.0, "F")
    fake.time += 0.5  # idle, e.g. waiting for a message: the next op starts afresh
    clock.sleep_until(clock.now() + 1.0, "F")
    assert fake.asked == [1.0, 1.0]
