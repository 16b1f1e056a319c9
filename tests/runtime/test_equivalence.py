"""A pipelined run equals a plain single-process run: loss, every gradient, parameters after a
step, eval outputs, with GPipe, 1F1B and interleaved (v=2) on p in {1, 2, 4}, m in {1, 3, 8},
and every other registered schedule (zero bubble, V placement) on p in {2, 4}.

One spawned group per p runs every case inside and compares against the reference computed
in-rank (the models are tiny), so the sweep costs three launches (full tier); the fast tier
runs every schedule family once at p = 2 in one launch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pipeline import PipelineEngine, PipelineModule, launch
from pipeline.model.reference import build_reference, reference_forward, reference_step
from schedules import SCHEDULES, figures, simulate
from tests.support.equivalence import TOLERANCE, describe_errors, max_error, new_errors, record_step
from tests.support.pipeline_models import MODELS, v_split_schedule

pytestmark = pytest.mark.multiprocess

Case = tuple[str, str, int, int, int]  # model, schedule, m, chunks, checkpoint interval


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


SEARCHED = ("zb-v-auto", "interleaved-zb", "v-min", "v-half", "dualpipev-overlap",
            "zb-optimal")
"""Schedules found by a search or solver (or overlapped pairs), each built on every rank."""


def _cases(p: int) -> list[Case]:
    cases = [(model, schedule, m, 2 if schedule == "interleaved" else 1, 0)
             for model in MODELS for schedule in ("gpipe", "1f1b", "interleaved")
             for m in (1, 3, 8)]
    cases += [("mlp", "1f1b", 3, 1, 2), ("transformer", "interleaved", 8, 2, 1)]
    if p == 2:  # split backward (I, W) and same-rank neighbours under V placement
        cases += [(model, "v-split", m, 2, 0) for model in MODELS for m in (1, 3)]
    if p > 1:  # every other registered schedule (zero bubble: I/W, V placement)
        cases += [(model, name, m, SCHEDULES[name].default_chunks, 0) for model in MODELS
                  for name in SCHEDULES if name not in ("gpipe", "1f1b", "interleaved",
                                                        "forward-only", *SEARCHED)
                  for m in (3, 8) if not (name == "dualpipev" and m < 2 * p)]
        # the searched and overlapped orders: one case each (their build is the cost)
        cases += [("mlp", name, 2 * p, SCHEDULES[name].default_chunks, 0) for name in SEARCHED]
        cases += [("mlp", "zb-h1", 3, 1, 2), ("transformer", "zb-v", 8, 2, 1)]  # + checkpoints
    return cases


def _family_cases() -> list[Case]:
    """p = 2: each registered schedule family once (of the searched ones, interleaved zero
    bubble and DualPipeV's overlapped pairs), split backward under V placement, and
    recomputation (checkpoint interval 1)."""
    cases: list[Case] = [("transformer", "1f1b", 3, 1, 0), ("mlp", "v-split", 3, 2, 0),
                         ("transformer", "interleaved", 4, 2, 1)]
    cases += [("mlp", name, 4, SCHEDULES[name].default_chunks, 0) for name in SCHEDULES
              if name not in ("1f1b", "forward-only", *SEARCHED)]
    cases += [("mlp", name, 4, 2, 0) for name in ("interleaved-zb", "dualpipev-overlap")]
    return cases


def _run_case(p: int, case: Case) -> dict[str, Any]:
    model, schedule, m, chunks, interval = case
    spec = MODELS[model]
    module = PipelineModule(spec.layers(), num_stages=p, chunks=chunks, loss_fn=spec.loss,
                            activation_checkpoint_interval=interval)
    plan: Any = v_split_schedule(m) if schedule == "v-split" else schedule
    engine = PipelineEngine(module, schedule=plan, num_microbatches=m, optimizer=_sgd,
                            timeout=30)
    reference = build_reference(spec.layers())
    errors = new_errors("eval")
    peak = 0
    for step, length in enumerate(spec.lengths):  # the transformer changes length per step
        inputs, targets = spec.batch(seed=step, length=length)
        loss = engine.train_batch(inputs, targets)
        expected = reference_step(reference, inputs, targets, loss_fn=spec.loss, optimizer=_sgd)
        record_step(errors, module.named_layer_parameters(), loss, expected, case)
        assert engine.last_stats is not None
        peak = max(peak, engine.last_stats.peak_activations)
    inputs, _ = spec.batch(seed=99, length=spec.lengths[0])
    outputs = engine.eval_batch(inputs)
    if engine.is_last_stage():
        reference.eval()
        with torch.no_grad():
            errors["eval"] = max_error(outputs, reference_forward(reference, inputs))
    simulated = figures(simulate(engine.schedule)).peak_activations[engine.pp_rank]
    return {"case": case, "pp_rank": engine.pp_rank, "errors": errors, "peak": peak,
            "simulated_peak": simulated, "num_params": len(list(module.parameters()))}


def _equivalence_rank(p: int, cases: list[Case]) -> dict[str, Any]:
    torch.manual_seed(0)
    results = [_run_case(p, case) for case in cases]
    # the measured timeline of the last step, gathered on every rank
    module = PipelineModule(MODELS["mlp"].layers(), num_stages=p, loss_fn=MODELS["mlp"].loss)
    engine = PipelineEngine(module, schedule="1f1b", num_microbatches=3, optimizer=_sgd)
    engine.train_batch(*MODELS["mlp"].batch(seed=0))
    timeline = engine.last_timeline()
    numbers = figures(timeline)
    # DeepSpeed style: an iterator of (inputs, targets) microbatches
    inputs, targets = MODELS["mlp"].batch(seed=1)
    pairs = iter(zip(inputs.chunk(3), targets.chunk(3)))
    expected = reference_step(build_reference(MODELS["mlp"].layers()), inputs, targets,
                              loss_fn=MODELS["mlp"].loss)
    fresh = PipelineEngine(PipelineModule(MODELS["mlp"].layers(), num_stages=p,
                                          loss_fn=MODELS["mlp"].loss),
                           schedule="1f1b", num_microbatches=3)
    data_iter_error = abs(fresh.train_batch(data_iter=pairs) - expected.loss)
    return {"results": results, "timeline_rows": len(timeline), "makespan": numbers.makespan,
            "timeline_ranks": sorted(set(timeline.rank.tolist())),
            "data_iter_error": data_iter_error}


@pytest.mark.full
@pytest.mark.parametrize("p", [1, 2, 4])
def test_pipeline_equals_single_process(p: int) -> None:
    _check_equivalence(p, _cases(p))


@pytest.mark.fast
def test_every_schedule_family_equals_single_process() -> None:
    _check_equivalence(2, _family_cases())


def _check_equivalence(p: int, cases: list[Case]) -> None:
    per_rank = launch(_equivalence_rank, p, p, cases, timeout=60, join_timeout=240)
    problems = []
    for rank, outcome in enumerate(per_rank):
        assert outcome["timeline_ranks"] == list(range(p))
        assert outcome["makespan"] > 0
        assert outcome["data_iter_error"] < TOLERANCE
        for result in outcome["results"]:
            problems += describe_errors(rank, result["case"], result["errors"])
            if result["peak"] > result["simulated_peak"]:
                problems.append(f"rank {rank} {result['case']}: held {result['peak']} "
                                f"activations, the simulator says {result['simulated_peak']}")
    assert not problems, "\n".join(problems)
    # every rank held part of the model, none all of it (for p > 1)
    counts = [outcome["results"][0]["num_params"] for outcome in per_rank]
    assert all(count > 0 for count in counts)
