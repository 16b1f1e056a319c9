"""The search's early stop of dominated simulations (`search._beaten_above`, T* =
max(t_K, t_M)) leaves the top K and the Pareto front exactly as without it, prediction for
prediction; T* is checked against its definition, and planted wrong thresholds are caught."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipeline.planner.search as search
from pipeline.planner import SearchOptions, plan
from pipeline.planner.predict import PlanContext, Prediction
from pipeline.planner.search import PlanResult
from pipeline.planner.step import Beaten

from .test_search_pruning import CASES

__all__: list[str] = []

TOP = 4
# a dense grid, tensor parallelism and V schedules, Megatron-LM 2021's engine (blocking
# messages, reduction after the flush), an overlapped parameter gather, tied embeddings
STOPPING = ["tight-8-devices", "tp-and-v-schedules", "megatron-2021-engine",
            "overlapped-param-gather", "tied-embeddings"]

Threshold = Callable[[np.ndarray, np.ndarray, float, SearchOptions], float]


def _never(times: np.ndarray, sizes: np.ndarray, memory: float,
           options: SearchOptions) -> float:
    return math.inf


def _search(case: str, threshold: Threshold | None,
            monkeypatch: pytest.MonkeyPatch) -> PlanResult:
    """The case's search with `threshold` as T* (None: the search's own)."""
    model, cluster, batch, options = CASES[case]
    with monkeypatch.context() as patch:
        if threshold is not None:
            patch.setattr(search, "_beaten_above", threshold)
        return plan(model, cluster, batch, options=replace(options, top=TOP))


def _differences(stopped: PlanResult, whole: PlanResult) -> list[str]:
    problems = []
    if stopped.predictions[:TOP] != whole.predictions[:TOP]:
        problems.append(f"top {TOP}: {[p.config.label() for p in stopped.predictions[:TOP]]}"
                        f" != {[p.config.label() for p in whole.predictions[:TOP]]}")
    if stopped.pareto() != whole.pareto():
        problems.append(f"front: {[p.config.label() for p in stopped.pareto()]} != "
                        f"{[p.config.label() for p in whole.pareto()]}")
    return problems


@pytest.mark.parametrize("case", STOPPING)
def test_early_stop_keeps_the_top_k_and_the_front_prediction_for_prediction(
        case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # every stopped simulation, priced in full, is longer than the T* it was stopped under
    honest_predict = PlanContext.predict
    beaten: list[tuple[float, float]] = []

    def checked(self: PlanContext, config: object, memory: object, *,
                beaten_above: float = math.inf) -> object:
        made = honest_predict(self, config, memory, beaten_above=beaten_above)  # type: ignore[arg-type]
        if isinstance(made, Beaten):
            whole = honest_predict(self, config, memory)  # type: ignore[arg-type]
            assert isinstance(whole, Prediction)
            beaten.append((whole.step_seconds, beaten_above))
        return made

    monkeypatch.setattr(PlanContext, "predict", checked)
    stopped = _search(case, None, monkeypatch)
    monkeypatch.undo()
    whole = _search(case, _never, monkeypatch)
    assert stopped.stopped_early > 0 and whole.stopped_early == 0
    assert len(beaten) == stopped.stopped_early
    assert all(step > threshold for step, threshold in beaten)
    assert _differences(stopped, whole) == []
    # the same configurations are skipped by the bound: a stopped one is never the only
    # witness of a skip, so the whole search simulated exactly the stopped ones more
    whole_by_config = {p.config: p for p in whole.predictions}
    assert all(whole_by_config[p.config] == p for p in stopped.predictions)
    assert len(stopped.predictions) + stopped.stopped_early == len(whole.predictions)
    assert stopped.skipped_by_bound == whole.skipped_by_bound


def _kth_only(times: np.ndarray, sizes: np.ndarray, memory: float,
              options: SearchOptions) -> float:
    """Planted: T* = t_K, memory ignored."""
    if not options.prune or len(times) < options.top:
        return math.inf
    return float(np.partition(times, options.top - 1)[options.top - 1])


def test_a_threshold_that_ignores_memory_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    assert any(_differences(_search(case, _kth_only, monkeypatch),
                            _search(case, _never, monkeypatch))
               for case in STOPPING[:2])


def _beaten_by_definition(step: float, times: np.ndarray, sizes: np.ndarray, memory: float,
                          top: int) -> bool:
    """K simulated ones strictly faster, one of those no larger."""
    faster = times < step
    return int(faster.sum()) >= top and bool((sizes[faster] <= memory).any())


def _threshold_errors(threshold: Threshold, times: list[int], sizes: list[int], memory: int,
                      top: int) -> list[float]:
    """Steps (each time, and between and around them) on which `threshold` and the
    definition disagree."""
    t, b = np.asarray(times, dtype=float), np.asarray(sizes, dtype=float)
    above = threshold(t, b, float(memory), SearchOptions(top=top))
    probes = sorted({*t, *(t + 0.5), -1.0, *(np.nextafter(t, np.inf))})
    return [step for step in probes
            if (step > above) != _beaten_by_definition(step, t, b, float(memory), top)]


@settings(max_examples=200, deadline=None)
@given(times=st.lists(st.integers(0, 6), max_size=9), data=st.data(),
       memory=st.integers(0, 6), top=st.integers(1, 4))
def test_the_threshold_is_the_definitions(times: list[int], data: st.DataObject, memory: int,
                                         top: int) -> None:
    sizes = data.draw(st.lists(st.integers(0, 6), min_size=len(times), max_size=len(times)))
    assert _threshold_errors(search._beaten_above, times, sizes, memory, top) == []
    assert search._beaten_above(np.asarray(times, dtype=float),
                                np.asarray(sizes, dtype=float), float(memory),
                                SearchOptions(top=top, prune=False)) == math.inf


def _at_or_above(times: np.ndarray, sizes: np.ndarray, memory: float,
                 options: SearchOptions) -> float:
    """Planted: a step equal to T* counted beaten too (>= instead of >)."""
    return float(np.nextafter(search._beaten_above(times, sizes, memory, options), -np.inf))


def _smallest_no_larger_only(times: np.ndarray, sizes: np.ndarray, memory: float,
                             options: SearchOptions) -> float:
    """Planted: T* = t_M, the K faster ones not required."""
    smaller = times[sizes <= memory]
    return float(smaller.min()) if len(smaller) else math.inf


@pytest.mark.parametrize("planted", [_kth_only, _at_or_above, _smallest_no_larger_only])
def test_planted_thresholds_disagree_with_the_definition(planted: Threshold) -> None:
    # ties, a faster larger configuration, fewer than K no larger
    examples = [([1, 2, 2, 3], [5, 1, 4, 2], 2, 2), ([1, 1, 2], [3, 3, 1], 2, 1),
                ([2, 2, 2, 4], [1, 1, 1, 1], 1, 3), ([1, 3], [9, 1], 1, 2), ([1, 2], [0, 0], 1, 3)]
    assert any(_threshold_errors(planted, *example) for example in examples)
