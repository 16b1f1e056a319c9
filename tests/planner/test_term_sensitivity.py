"""The sensitivity table (`benchmarks/term_sensitivity.py`, docs/planner.md): every term
switched off makes each case no slower, the Ampere-only epilogue moves only the A100 case,
and a switch that does nothing would be seen."""

from __future__ import annotations

import re
from contextlib import nullcontext

import pytest

from benchmarks import term_sensitivity

__all__: list[str] = []

_ROW = re.compile(r"\| (.+?) \| (.+?) \| ([\d.]+) s \| ([\d.]+) s \| ([+-][\d.]+)% \|")


def _moves() -> dict[tuple[str, str], float]:
    moves = {}
    for line in term_sensitivity.sensitivity_lines()[2:]:
        found = _ROW.fullmatch(line)
        assert found, line
        moves[found[1], found[2]] = float(found[5])
    return moves


def test_every_term_moves_its_cases_the_expected_way() -> None:
    moves = _moves()
    assert len(moves) == len(term_sensitivity.TERMS) * len(term_sensitivity.CASES) == 24
    # a term switched off makes no case slower; NCCL's model is compared with the α–β one
    # it replaced, and may go either way, but moves each case
    assert all(move >= 0 for (term, _), move in moves.items() if "nccl_model" not in term)
    assert all(move != 0 for (term, _), move in moves.items() if "nccl_model" in term)
    epilogue = {case: move for (term, case), move in moves.items() if "epilogue" in term}
    a100 = [case for case in epilogue if "A100" in case]
    assert len(a100) == 1 and epilogue[a100[0]] > 1.0
    assert all(move == 0 for case, move in epilogue.items() if "H100" in case)
    tiles = [move for (term, _), move in moves.items() if "wave quantization" in term]
    assert min(tiles) > 1.0


def test_a_switch_that_switches_nothing_off_reads_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: a term whose switch is a no-op must show +0.0 % everywhere (the table reads
    each case under the switch, not the baseline twice)."""
    monkeypatch.setattr(term_sensitivity, "TERMS", (("no-op", nullcontext),))
    moves = _moves()
    assert set(moves.values()) == {0.0}
