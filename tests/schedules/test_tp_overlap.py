"""The exposed-tp-communication rule against an event simulation of the engine's op order."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedules.analysis.tp_overlap import (
    ParallelLinearCosts,
    linear_exposed,
    linears_exposed,
    pipelined_exposed,
)
from schedules.ir.errors import ScheduleConfigError

Op = tuple[str, float]


def _ops(linear: ParallelLinearCosts, sp: bool, overlap: bool, chunks: int
         ) -> tuple[list[Op], list[Op]]:
    """The (forward, backward) op order of `pipeline.parallel.tensor.overlap`, written out:
    ("gemm", s), ("launch", s) and ("wait", index of the launch)."""
    c = chunks if overlap else 1
    q = linear.chunk_collective if overlap else linear.collective
    whole = linear.collective

    def gathered(gemm: float) -> list[Op]:  # launch every slice, then wait + GEMM each
        ops: list[Op] = [("launch", q)] * c
        for k in range(c):
            ops += [("wait", k), ("gemm", gemm / c)]
        return ops

    if linear.kind == "column":
        forward = gathered(linear.forward) if sp else [("gemm", linear.forward)]
        backward: list[Op] = []
        launches = 0
        if sp:
            backward.append(("launch", whole))
            launches = 1
            if not overlap:
                backward.append(("wait", 0))
        backward.append(("gemm", linear.input_grad))
        if sp and overlap:
            backward.append(("wait", 0))
        backward.append(("launch", whole))
        if not overlap:
            backward.append(("wait", launches))
        backward += [("gemm", linear.weight_grad), ("wait", launches)]
        return forward, backward
    forward = []
    for k in range(c):
        forward += [("gemm", linear.forward / c), ("launch", q)]
        if not overlap:
            forward.append(("wait", k))
    forward += [("wait", k) for k in range(c)]
    backward = gathered(linear.input_grad) if sp else [("gemm", linear.input_grad)]
    return forward, [*backward, ("gemm", linear.weight_grad)]


def _exposed(ops: list[Op]) -> float:
    """Run `ops`: the device does GEMMs and waits, the link one collective at a time."""
    now = link = busy = 0.0
    ends: list[float] = []
    for kind, value in ops:
        if kind == "gemm":
            now += value
            busy += value
        elif kind == "launch":
            link = max(now, link) + value
            ends.append(link)
        else:
            now = max(now, ends[int(value)])
    return now - busy


seconds = st.floats(min_value=0.0, max_value=10.0, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from(["column", "row"]), forward=seconds, input_grad=seconds,
       weight_grad=seconds, collective=seconds, share=st.floats(0.0, 1.0),
       sp=st.booleans(), overlap=st.booleans(), chunks=st.integers(1, 5))
def test_rule_equals_an_event_simulation_of_the_engine_order(
        kind: str, forward: float, input_grad: float, weight_grad: float, collective: float,
        share: float, sp: bool, overlap: bool, chunks: int) -> None:
    linear = ParallelLinearCosts(kind, forward, input_grad, weight_grad,  # type: ignore[arg-type]
                                 collective, collective * share)
    forward_ops, backward_ops = _ops(linear, sp, overlap, chunks)
    got = linear_exposed(linear, sequence_parallel=sp, overlap=overlap, chunks=chunks)
    assert got == pytest.approx((_exposed(forward_ops), _exposed(backward_ops)), abs=1e-9)


def test_overlap_hides_what_the_gemms_cover() -> None:
    column = ParallelLinearCosts("column", 4.0, 4.0, 4.0, 3.0, 2.0)
    row = ParallelLinearCosts("row", 4.0, 4.0, 4.0, 3.0, 2.0)
    # no overlap, sequence parallel: column gathers (fwd) and gathers + reduces (bwd), row
    # reduces (fwd) and gathers (bwd): every collective whole
    assert linears_exposed([column, row], sequence_parallel=True, overlap=False) == (6.0, 9.0)
    # overlap, two chunks of 2 s against GEMM halves of 2 s: one chunk exposed per
    # pipelined collective; the beside ones (3 s against 4 s GEMMs) fully hidden
    assert linears_exposed([column, row], sequence_parallel=True, overlap=True) == (4.0, 2.0)
    assert linear_exposed(column, sequence_parallel=False, overlap=True) == (0.0, 0.0)


def _planted_rule(compute: float, chunk_collective: float, chunks: int) -> float:
    """A wrong rule: the pipeline's stalls forgotten (only the first chunk exposed)."""
    return chunk_collective


@pytest.mark.parametrize("rule", [pipelined_exposed, _planted_rule])
def test_the_oracle_catches_a_planted_rule(rule: Callable[[float, float, int], float]) -> None:
    # a link slower than the GEMMs: each later chunk stalls the device by q - G/c
    simulated = _exposed([("launch", 3.0)] * 3 + [op for k in range(3)
                                                   for op in (("wait", k), ("gemm", 1.0))])
    if rule is _planted_rule:
        assert rule(3.0, 3.0, 3) != pytest.approx(simulated)
    else:
        assert rule(3.0, 3.0, 3) == pytest.approx(simulated) == 7.0


def test_bad_costs_are_refused_by_name() -> None:
    with pytest.raises(ScheduleConfigError, match="collective must be a finite number"):
        ParallelLinearCosts("row", 1.0, 1.0, 1.0, -1.0, 0.5)
    with pytest.raises(ScheduleConfigError, match="kind must be 'column' or 'row'"):
        ParallelLinearCosts("diagonal", 1.0, 1.0, 1.0, 1.0, 0.5)  # type: ignore[arg-type]
    with pytest.raises(ScheduleConfigError, match="chunks must be an int >= 1, got 0"):
        pipelined_exposed(1.0, 1.0, 0)
