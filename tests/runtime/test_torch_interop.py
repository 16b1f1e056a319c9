"""Schedules cross between engines on CPU ranks, and both equal the single-process reference.

- Ours on torch: a schedule made here is saved as torch's CSV ("compute_only" from a
  generator's output, which torch lowers itself; "compute_comms" from our lowered one, which
  torch runs as written) and run by torch 2.13's `_PipelineScheduleRuntime` over torch
  `PipelineStage`s holding the same layers (`pipeline.torch_stages` / `torch_runtime`).
- Torch's on ours: the CSV torch's own schedule classes dump (GPipe, Interleaved1F1B,
  LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV; both formats) is parsed,
  validated, simulated, plotted, and run by `PipelineEngine`.
Each run checks the loss, every gradient and every parameter after two SGD steps.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
import torch.distributed as dist

from pipeline import PipelineModule, launch
from pipeline.model.reference import build_reference, reference_step
from schedules import (
    Schedule,
    add_optimizer_step,
    build_schedule,
    figures,
    fuse_backward,
    generate_schedule,
    lower,
    parse_torch_csv,
    simulate,
    validate,
)
from tests.support.equivalence import (
    EngineCase,
    describe_errors,
    engine_case_problems,
    new_errors,
    record_step,
    run_engine_case,
    sgd,
)
from tests.support.pipeline_models import MODELS
from tests.support.torch_helpers import dump_torch_csv
from viz import plot_timeline

pytestmark = pytest.mark.multiprocess

Form = Literal["compute_only", "compute_comms"]
TorchCase = tuple[str, str, Schedule]
"""(label, model name, schedule torch runs: compute-only or lowered)."""

OURS = ("1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev", "looped-bfs", "zb-auto")
TORCHS = ("GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
          "DualPipeV")


def _ours_for_torch(p: int) -> list[TorchCase]:
    m = 2 * p  # dualpipev's smallest
    cases = [(f"{name} m={m} {form}", "mlp", make(name, p, m))
             for name in OURS
             for form, make in (("compute_only", generate_schedule),
                                ("compute_comms", build_schedule))]
    fused = fuse_backward(generate_schedule("zb-v", p, m))  # torch's runtime mixes B and I/W
    cases += [(f"fuse_backward(zb-v m={m}) compute_only", "mlp", fused),
              (f"fuse_backward(zb-v m={m}) compute_comms", "mlp",
               add_optimizer_step(lower(fused)))]
    cases += [(f"{name} m={p + 1} compute_only", "transformer", generate_schedule(name, p, p + 1))
              for name in ("zb-h1", "zb-v")]
    return cases


def _torch_runs_case(p: int, case: TorchCase, csv_path: str) -> dict[str, Any]:
    label, model, schedule = case
    spec = MODELS[model]
    m = schedule.num_microbatches
    module = PipelineModule(spec.layers(), num_stages=p, chunks=schedule.chunks,
                            loss_fn=spec.loss)
    # imported in the rank: torch.distributed.pipelining costs seconds at collection
    from pipeline import torch_runtime, torch_stages

    stages = torch_stages(module, schedule)
    runtime = torch_runtime(schedule, stages, csv_path, loss_fn=spec.loss)
    optimizer = sgd(module.parameters())
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    reference = build_reference(spec.layers())
    errors = new_errors()
    # two steps (no state may carry over) of one shape: torch's stages infer the shapes of
    # activations once, on the first step (the transformer's length cannot change)
    for step, length in enumerate(spec.lengths[:1] * 2):
        inputs, targets = spec.batch(seed=step, batch=3 * m, length=length)
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        runtime.step(*((inputs,) if first else ()), target=targets if last else None,
                     losses=losses)
        optimizer.step()
        loss = statistics.fmean(float(value.detach()) for value in losses) if last else None
        expected = reference_step(reference, inputs, targets, loss_fn=spec.loss, optimizer=sgd)
        record_step(errors, module.named_layer_parameters(), loss, expected, label)
    return {"label": label, "errors": errors}


def _torch_rank(p: int, cases: list[TorchCase], csv_dir: str) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    return [_torch_runs_case(p, case, f"{csv_dir}/{index}-rank{dist.get_rank()}.csv")
            for index, case in enumerate(cases)]


@pytest.mark.parametrize("p", [2, 4])
def test_torch_runtime_runs_our_schedules(p: int, tmp_path: Path) -> None:
    cases = _ours_for_torch(p)
    per_rank = launch(_torch_rank, p, p, cases, str(tmp_path), timeout=60, join_timeout=240)
    problems = [line for rank, results in enumerate(per_rank) for result in results
                for line in describe_errors(rank, result["label"], result["errors"])]
    assert not problems, "\n".join(problems)
    written = sorted(path.name for path in tmp_path.glob("*.csv"))
    assert len(written) == len(cases) * p  # every rank saved the CSV it loaded


def _torchs_for_us(p: int, directory: Path) -> list[EngineCase]:
    """torch's schedules at m = 2p, read from the CSV torch dumps, validated, simulated and
    plotted; the transformer also runs torch's ZBV."""
    m = 2 * p
    cases: list[EngineCase] = []
    for name in TORCHS:
        forms: tuple[Form, ...] = ("compute_only",) if name == "GPipe" else (
            "compute_only", "compute_comms")
        for form in forms:
            path = directory / f"torch-{name}-{form}.csv"
            dump_torch_csv(name, p, m, path, form)
            schedule = parse_torch_csv(path.read_text(), name=f"torch {name}",
                                       num_microbatches=m)
            assert schedule.lowered == (form == "compute_comms")
            validate(schedule)
            timeline = simulate(schedule)
            assert 0.0 <= figures(timeline).bubble_rate < 0.6
            image = plot_timeline(timeline, path.with_suffix(".png"))
            assert image is not None and path.with_suffix(".png").stat().st_size > 1000
            cases.append((f"torch {name} m={m} {form}", "mlp", schedule, None))
    zbv = parse_torch_csv((directory / "torch-ZBVZeroBubble-compute_comms.csv").read_text(),
                          name="torch ZBVZeroBubble", num_microbatches=m)
    cases.append((f"torch ZBVZeroBubble m={m} compute_comms", "transformer", zbv, None))
    return cases


def _engine_rank(p: int, cases: list[EngineCase]) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    return [run_engine_case(p, case) for case in cases]


@pytest.mark.parametrize("p", [2, 4])
def test_our_engine_runs_torchs_schedules(p: int, tmp_path: Path) -> None:
    cases = _torchs_for_us(p, tmp_path)
    per_rank = launch(_engine_rank, p, p, cases, timeout=60, join_timeout=240)
    problems = engine_case_problems(per_rank)
    assert not problems, "\n".join(problems)

