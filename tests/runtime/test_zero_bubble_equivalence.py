"""Zero-bubble and V schedules equal a single process where test_engine_equivalence does not look.

That file runs every registered schedule (zb-h1, zb-h2, zb-v, dualpipev, looped-bfs, zb-auto)
with both models at p in {2, 4} and m in {3, 8}. Here, on p in {2, 3} (3: an odd p, and a V
whose middle rank holds two inner stages):
- m at the generators' edges: 1, p and 2p - 1 (warm-up longer than the batch, exactly one
  round, ZB-H2's full warm-up); dualpipev at its smallest m = 2p and at 2p + 1;
- zb-auto under memory limits 1, p and 2p - 1 (the engine must hold no more than the limit)
  and under unequal costs, which change the greedy's order;
- `fuse_backward`ed schedules: adjacent pairs only (a stage then runs both B and I/W),
  every pair, and one chunk of a V only;
- the transformer (tuple activations, a bool mask, sequence length changing between steps)
  at m = p.
Every case checks the loss, every gradient and every parameter after an SGD step, and that
the measured peak of held activations stays within the simulator's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pipeline import launch
from schedules import CostModel, Kind, fuse_backward, generate_schedule
from tests.support.equivalence import EngineCase, engine_case_problems, run_engine_case

pytestmark = pytest.mark.multiprocess

SPLIT_BACKWARD = ("zb-h1", "zb-h2", "zb-v", "dualpipev", "zb-auto")


def _cases(p: int) -> list[EngineCase]:
    covered = {3, 8} if p in (2, 4) else set()  # m that test_engine_equivalence runs
    edges = sorted({1, p, 2 * p - 1} - covered)
    cases: list[EngineCase] = [
        (f"{name} m={m}", "mlp", generate_schedule(name, p, m), None)
        for name in ("zb-h1", "zb-h2", "zb-v", "looped-bfs", "zb-auto") for m in edges]
    cases += [(f"dualpipev m={m}", "mlp", generate_schedule("dualpipev", p, m), None)
              for m in (2 * p, 2 * p + 1)]
    m = 2 * p
    cases += [(f"zb-auto m={m} limit={limit}", "mlp",
               generate_schedule("zb-auto", p, m, memory_limit=limit), limit)
              for limit in (1, p, 2 * p - 1)]
    costs = CostModel(forward=1.0, backward=2.0, weight=0.5, comm=0.3)
    cases.append((f"zb-auto m={m} costs=F1,B2,W0.5,c0.3", "mlp",
                  generate_schedule("zb-auto", p, m, costs=costs), 2 * p))
    for name in SPLIT_BACKWARD:
        for where in ("adjacent", "all"):
            cases.append((f"fuse_backward({name} m={m}, {where})", "mlp",
                          fuse_backward(generate_schedule(name, p, m), where=where), None))
    for name in ("zb-v", "dualpipev"):  # the V's first chunk fused, its second split
        first_chunk = fuse_backward(generate_schedule(name, p, m), where="all",
                                    wanted=lambda op: op.stage < p)
        cases.append((f"fuse_backward({name} m={m}, all, stages < p)", "mlp", first_chunk,
                      None))
    cases += [(f"{name} m={p}", "transformer", generate_schedule(name, p, p), None)
              for name in ("zb-h1", "zb-h2", "zb-v", "zb-auto")]
    cases.append((f"fuse_backward(dualpipev m={m}, adjacent)", "transformer",
                  fuse_backward(generate_schedule("dualpipev", p, m)), None))
    return cases


def _equivalence_rank(p: int, cases: list[EngineCase]) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    return [run_engine_case(p, case) for case in cases]


def test_the_cases_are_what_they_say() -> None:
    for p in (2, 3):
        for label, _, schedule, _ in _cases(p):
            kinds = {op.kind for stream in schedule.streams for op in stream}
            if "fuse_backward" in label:
                assert Kind.B in kinds, label
                assert (Kind.I in kinds) == ("all)" not in label), label
            elif not label.startswith("looped-bfs"):  # the split backward is exercised
                assert {Kind.I, Kind.W} <= kinds, label


@pytest.mark.parametrize("p", [2, 3])
def test_zero_bubble_edges_equal_single_process(p: int) -> None:
    cases = _cases(p)
    per_rank = launch(_equivalence_rank, p, p, cases, timeout=60, join_timeout=240)
    problems = engine_case_problems(per_rank)
    assert not problems, "\n".join(problems)
