"""The fast generators return exactly what the slow ones did: issue 33's speed-up changes no output.

Oracle: `tests/support/reference_generators`, verbatim copies of the generators before they
were made faster. Equal means the same `Schedule` (name, placement, streams) with every
instruction an `Instruction` of plain ints (numpy integers compare equal but are not what
the rest of the code expects), and a refused input refused with the same error and message.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedules.generators import classic, controllable_memory, dualpipe, zb_h1_h2, zb_v
from schedules.ir import instructions, steps
from schedules.ir.instructions import Instruction, Kind
from schedules.ir.schedule import Schedule
from tests.support.reference_generators import classic as ref_classic
from tests.support.reference_generators import controllable_memory as ref_controllable_memory
from tests.support.reference_generators import dualpipe as ref_dualpipe
from tests.support.reference_generators import steps as ref_steps
from tests.support.reference_generators import zb_h1_h2 as ref_zb_h1_h2
from tests.support.reference_generators import zb_v as ref_zb_v

Streams = tuple[tuple[Instruction, ...], ...]


def _outcome(make: Callable[..., object], *args: object, **kwargs: object) -> object:
    """What `make(*args, **kwargs)` returns, or (error type, message) when it raises."""
    try:
        return make(*args, **kwargs)
    except Exception as error:  # any error must match the reference's
        return type(error), str(error)


def _check_plain(streams: Streams) -> None:
    for stream in streams:
        assert type(stream) is tuple
        for op in stream:
            assert type(op) is Instruction and type(op.kind) is Kind, op
            assert (type(op.stage), type(op.microbatch), type(op.peer)) == (int, int, int), op


def _same(fast: Callable[..., object], slow: Callable[..., object], *args: object,
          **kwargs: object) -> None:
    """`fast` and `slow` have the same outcome for these arguments."""
    got, want = _outcome(fast, *args, **kwargs), _outcome(slow, *args, **kwargs)
    assert got == want
    if isinstance(got, Schedule):
        assert type(got.streams) is tuple
        _check_plain(got.streams)
    elif isinstance(got, tuple) and got and isinstance(got[0], Instruction):  # one stream
        _check_plain((got,))  # type: ignore[arg-type]
    elif isinstance(got, tuple) and got and isinstance(got[0], tuple):  # streams
        _check_plain(got)  # type: ignore[arg-type]


counts = st.integers(1, 14)
sizes = st.integers(1, 40)


@given(p=counts, m=sizes, v=st.integers(1, 4))
def test_classic_and_zero_bubble_handcrafted(p: int, m: int, v: int) -> None:
    _same(classic.one_f_one_b, ref_classic.one_f_one_b, p, m)
    _same(classic.gpipe, ref_classic.gpipe, p, m)
    _same(classic.interleaved_1f1b, ref_classic.interleaved_1f1b, p, m, v)
    _same(classic.forward_only, ref_classic.forward_only, p, m, v)
    for hops in (1, 2):
        _same(classic.interleaved_order, ref_classic.interleaved_order, p, m, v,
              warmup_hops=hops)
    _same(zb_h1_h2.zb_h1, ref_zb_h1_h2.zb_h1, p, m)
    _same(zb_h1_h2.zb_h2, ref_zb_h1_h2.zb_h2, p, m)


@given(p=counts, m=st.integers(1, 48))
def test_v_shaped_step_tables(p: int, m: int) -> None:
    _same(zb_v.zb_v, ref_zb_v.zb_v, p, m)
    for overlap in (False, True):  # m < 2p: the same refusal
        _same(dualpipe.dualpipev, ref_dualpipe.dualpipev, p, m, overlap=overlap)
    _same(dualpipe.dualpipev, ref_dualpipe.dualpipev, p, 2 * p + m, overlap=True)


@pytest.mark.parametrize("p", range(1, 10))
def test_v_min_and_v_half_small(p: int) -> None:
    """Every m up to 13 for p <= 9: p = 1, 2, 3, both parities and both residues of p mod 3
    that change the building block's shift."""
    for m in range(1, 14):
        _same(controllable_memory.v_min, ref_controllable_memory.v_min, p, m)
        _same(controllable_memory.v_half, ref_controllable_memory.v_half, p, m)


@pytest.mark.parametrize(("variant", "p", "m"), [
    ("min", 48, 16), ("half", 48, 16), ("half", 24, 24), ("min", 16, 64), ("min", 15, 31),
    ("half", 13, 40), ("min", 21, 5), ("half", 22, 7)])
def test_v_min_and_v_half_at_planner_sizes(variant: str, p: int, m: int) -> None:
    name = f"v_{variant}"
    _same(getattr(controllable_memory, name), getattr(ref_controllable_memory, name), p, m)


def test_large_step_tables_and_interleaved() -> None:
    _same(zb_v.zb_v, ref_zb_v.zb_v, 64, 160)
    _same(dualpipe.dualpipev, ref_dualpipe.dualpipev, 48, 130, overlap=True)
    _same(classic.interleaved_1f1b, ref_classic.interleaved_1f1b, 24, 100, 3)


def test_refused_counts() -> None:
    pairs = ((classic.one_f_one_b, ref_classic.one_f_one_b),
             (zb_h1_h2.zb_h1, ref_zb_h1_h2.zb_h1), (zb_v.zb_v, ref_zb_v.zb_v),
             (controllable_memory.v_min, ref_controllable_memory.v_min),
             (dualpipe.dualpipev, ref_dualpipe.dualpipev))
    for bad in (0, -1, True, 2.0, "4", None):
        for fast, slow in pairs:
            _same(fast, slow, bad, 4)
            _same(fast, slow, 4, bad)
        _same(classic.interleaved_1f1b, ref_classic.interleaved_1f1b, 4, 8, bad)


# Step tables of every token (bare W, W of a chunk, I before or after its W) and counts <= 0;
# I comes up more often than W so that most tables run to the end.
_GOOD = ["F0", "F1", "B0", "B1", "I0", "I1", "I0", "I1", "I0", "I1", "W0", "W1", "W", "W"]
_ANY = [*_GOOD, "F2", "I2", "W2", "F", "X1", "W9", "F01", "B"]


def _tables(tokens: list[str]) -> st.SearchStrategy[list[tuple[int, str]]]:
    pattern = st.lists(st.sampled_from(tokens), min_size=1, max_size=6).map(" ".join)
    return st.lists(st.tuples(st.integers(-1, 6), pattern), max_size=8)


@settings(max_examples=200)
@given(table=_tables(_GOOD), m=st.integers(1, 12))
def test_emit_steps_on_any_table(table: list[tuple[int, str]], m: int) -> None:
    _same(steps.emit_steps, ref_steps.emit_steps, (7, 2), table, m)


@given(table=_tables(_ANY), chunks=st.integers(1, 3), m=st.integers(1, 12))
def test_emit_steps_refuses_alike(table: list[tuple[int, str]], chunks: int, m: int) -> None:
    stages = tuple(range(5, 5 + 3 * chunks, 3))
    _same(steps.emit_steps, ref_steps.emit_steps, stages, table, m)


def test_shared_ops_are_the_instructions_and_never_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """`stage_ops` gives Instruction(kind, stage, i) at index i; a list once handed out keeps
    its length when the table grows, and past the limit the tables start afresh."""
    monkeypatch.setattr(instructions, "SHARED_OPS_LIMIT", 50)
    monkeypatch.setattr(instructions, "_shared", {})
    monkeypatch.setattr(instructions, "_num_shared", 0)
    handed_out = []
    for kind, stage, count in [(Kind.F, 3, 10), (Kind.F, 3, 30), (Kind.W, 0, 15),
                               (Kind.F, 3, 12), (Kind.B, 1, 20), (Kind.F, 3, 40)]:
        ops = instructions.stage_ops(kind, stage, count)
        assert ops[:count] == [Instruction(kind, stage, i) for i in range(count)]
        handed_out.append((ops, len(ops)))
    assert [len(ops) for ops, _ in handed_out] == [n for _, n in handed_out]
    assert instructions._num_shared <= 50 and len(instructions._shared) == 1  # cleared twice
