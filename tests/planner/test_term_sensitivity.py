"""The sensitivity table (`benchmarks/term_sensitivity.py`, docs/planner.md): every cost term
switched off makes each case no slower, the Ampere-only epilogue moves only the A100 case,
DeepEP's one copy per node (a saving) only the case whose ep group spans nodes, and a switch
that does nothing would be seen."""

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
    assert len(moves) == len(term_sensitivity.TERMS) * len(term_sensitivity.CASES)
    # a term switched off makes no case slower, except two compared with what they replaced:
    # NCCL's model against the α–β one (either way, but it moves each case) and DeepEP's one
    # copy per node (a saving, on the case whose ep group spans nodes alone)
    per_node = {case: move for (term, case), move in moves.items() if "per node" in term}
    assert all(move >= 0 for (term, _), move in moves.items()
               if "nccl_model" not in term and "per node" not in term)
    assert all(move != 0 for (term, _), move in moves.items() if "nccl_model" in term)
    assert [case for case, move in per_node.items() if move != 0] == [
        case for case in per_node if "deepep" in case]
    assert all(move < -5.0 for case, move in per_node.items() if "deepep" in case)
    epilogue = {case: move for (term, case), move in moves.items() if "epilogue" in term}
    a100 = [case for case in epilogue if "A100" in case]
    assert len(a100) == 1 and epilogue[a100[0]] > 1.0
    assert all(move == 0 for case, move in epilogue.items() if "H100" in case)
    # the host's issue time hides under these cases' device time (`host_launch`: each pass
    # the longer of the two; large layers at b1 keep the device behind)
    host = [move for (term, _), move in moves.items() if "host issue" in term]
    assert len(host) == len(term_sensitivity.CASES) and all(0 <= move < 0.5 for move in host)
    tiles = [move for (term, _), move in moves.items() if "wave quantization" in term]
    assert min(tiles) > 1.0
    # the MoE block's terms (`expert_kernels`) move the MoE cases alone, each of them
    moe = {(term, case): move for (term, case), move in moves.items()
           if term.startswith("MoE: ")}
    assert len(moe) == 4 * len(term_sensitivity.CASES)
    assert all((move > 0) == ("Mixtral" in case or "DeepSeek" in case)
               for (_, case), move in moe.items())


def test_a_switch_that_switches_nothing_off_reads_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: a term whose switch is a no-op must show +0.0 % everywhere (the table reads
    each case under the switch, not the baseline twice)."""
    monkeypatch.setattr(term_sensitivity, "TERMS", (("no-op", nullcontext),))
    moves = _moves()
    assert set(moves.values()) == {0.0}
