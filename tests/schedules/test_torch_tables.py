"""Schedules travel to and from torch.distributed.pipelining (2.13): its tables, parser, lowering.

Uses torch's private schedule helpers with stand-in stages (no process group, no model):
`get_schedule_ops` from its visualizer, `_Action.from_str`, `_validate_schedule`,
`_simulate_comms_compute`, `_merge_bw` and `_PipelineScheduleRuntime._load_csv`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

import pytest

pytest.importorskip("torch")

from schedules import (
    Schedule,
    ScheduleValidationError,
    add_optimizer_step,
    build_schedule,
    dualpipev,
    figures,
    format_torch_csv,
    from_torch_rows,
    fuse_backward,
    generate_schedule,
    lower,
    parse_torch_csv,
    simulate,
    to_torch_rows,
    validate,
    zb_v,
)
from tests.support.torch_helpers import (
    dump_torch_csv,
    pipelining_schedules,
    stand_in_stages,
    torch_rows,
)

if TYPE_CHECKING:
    from torch.distributed.pipelining import schedules as torch_schedules

MULTI_STAGE = ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
               "DualPipeV"]
SIZES = [(2, 4), (3, 6), (4, 8), (4, 12)]
OURS = [("zb-h1", None), ("zb-h2", None), ("zb-v", None), ("dualpipev", None),
        ("looped-bfs", 2), ("zb-auto", None), ("interleaved", 2)]


@pytest.mark.parametrize("with_comms", [False, True])
@pytest.mark.parametrize(("p", "m"), SIZES)
@pytest.mark.parametrize("name", MULTI_STAGE)
def test_torchs_schedules_load_validate_and_simulate(name: str, p: int, m: int,
                                                    with_comms: bool) -> None:
    schedule = from_torch_rows(torch_rows(name, p, m, with_comms=with_comms),
                               num_microbatches=m)
    assert schedule.lowered == with_comms
    validate(schedule)  # a torch compute_comms order is also deadlock-free under rendezvous
    if not with_comms:
        validate(add_optimizer_step(lower(schedule)))
    result = figures(simulate(schedule))
    assert 0.0 <= result.bubble_rate < 0.5


@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 3), (3, 5), (4, 8), (5, 13)])
def test_our_zb_v_and_dualpipev_are_torchs_orders(p: int, m: int) -> None:
    assert from_torch_rows(torch_rows("ZBVZeroBubble", p, m, with_comms=False),
                           name="zb-v", num_microbatches=m) == zb_v(p, m)
    if m >= 2 * p:
        assert from_torch_rows(torch_rows("DualPipeV", p, m, with_comms=False),
                               name="dualpipev", num_microbatches=m) == dualpipev(p, m)


@pytest.mark.parametrize(("name", "chunks"), OURS)
def test_torchs_parser_and_checks_accept_ours(name: str, chunks: int | None) -> None:
    torch_schedules = pipelining_schedules()
    p, m = 4, 8
    compute = generate_schedule(name, p, m, chunks)
    lowered = build_schedule(name, p, m, chunks)
    for schedule in (compute, lowered):
        for row in to_torch_rows(schedule):
            assert [str(torch_schedules._Action.from_str(cell)) for cell in row] == row
    compute_actions = _actions(to_torch_rows(compute))
    mapping = torch_schedules._validate_schedule(compute_actions, p, compute.num_stages, m)
    assert tuple(mapping[s] for s in range(compute.num_stages)) == compute.placement
    comm_actions = _actions(to_torch_rows(lowered, reduce_grad=False))
    torch_schedules._simulate_comms_compute(
        comm_actions, lambda s: lowered.placement[s], lowered.num_stages)


@pytest.mark.parametrize("form", ["compute_only", "compute_comms"])
@pytest.mark.parametrize("name", ["zb-v", "dualpipev"])
def test_torchs_runtime_loads_our_csv(name: str, form: Literal["compute_only", "compute_comms"],
                                      tmp_path: Path) -> None:
    torch_schedules = pipelining_schedules()
    p, m = 3, 6
    schedule = (generate_schedule if form == "compute_only" else build_schedule)(name, p, m)
    path = tmp_path / f"{name}.csv"
    path.write_text(format_torch_csv(schedule))
    runtime = torch_schedules._PipelineScheduleRuntime(stand_in_stages(p, 2), m)
    runtime._load_csv(str(path), format=form)
    ours = format_torch_csv(schedule).splitlines()
    if form == "compute_comms":
        assert [",".join(map(str, runtime.pipeline_order_with_comms[r])) for r in range(p)] \
            == ours
    else:
        assert [",".join(map(str, runtime.pipeline_order[r])) for r in range(p)] == ours
        relowered = from_torch_rows(
            [[str(a) for a in runtime.pipeline_order_with_comms[r]] for r in range(p)],
            num_microbatches=m)
        validate(relowered)  # torch's lowering of our order, checked by our validator


def test_fuse_backward_matches_torchs_merge_bw() -> None:
    torch_schedules = pipelining_schedules()
    compute = generate_schedule("zb-v", 3, 6)
    fused = fuse_backward(compute)
    for rank, row in enumerate(to_torch_rows(compute)):
        merged = torch_schedules._merge_bw([torch_schedules._Action.from_str(c) for c in row])
        assert [str(a) for a in merged] == [str(op) for op in fused.streams[rank]]


def _actions(rows: list[list[str]]) -> dict[int, list[torch_schedules._Action | None]]:
    torch_schedules = pipelining_schedules()
    return {rank: [torch_schedules._Action.from_str(cell) for cell in row]
            for rank, row in enumerate(rows)}


def test_loaded_torch_schedule_keeps_its_name_and_placement() -> None:
    schedule: Schedule = from_torch_rows(torch_rows("ZBVZeroBubble", 2, 4, with_comms=True),
                                         name="torch-zbv")
    assert schedule.name == "torch-zbv" and schedule.placement == (0, 1, 1, 0)


def test_torch_stages_refuse_a_schedule_that_does_not_fit_the_module() -> None:
    from pipeline import PipelineConfigError, PipelineModule, torch_stages
    from tests.support.pipeline_models import MODELS

    module = PipelineModule(MODELS["mlp"].layers(), num_stages=2)  # one chunk per rank
    with pytest.raises(PipelineConfigError, match=r"cannot build torch stages.*chunks=2"):
        torch_stages(module, generate_schedule("zb-v", 2, 4), rank=0)
    with pytest.raises(PipelineConfigError, match="rank 2 is outside"):
        torch_stages(module, generate_schedule("zb-h1", 2, 4), rank=2)
    assert not module.stages  # nothing was built


def test_torchs_1f1b_table_is_refused_not_run(tmp_path: Path) -> None:
    # torch 2.13's Schedule1F1B table (the one `_dump_csv`-style tools see, not what its
    # `_step_microbatches` runs) numbers the last rank's forwards from 1: refused up front.
    path = tmp_path / "torch-1F1B.csv"
    dump_torch_csv("1F1B", 2, 4, path, "compute_only")
    with pytest.raises(ScheduleValidationError, match="microbatch 4 is outside"):
        validate(parse_torch_csv(path.read_text(), num_microbatches=4))
