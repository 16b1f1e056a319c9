"""Inference with its own microbatch count, outputs broadcast to every rank of the pipeline."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import PipelineEngine, PipelineModule
from pipeline.errors import PipelineConfigError
from pipeline.model.reference import build_reference, reference_forward
from pipeline.runtime.inference import Inference, forward_only_schedule
from schedules import loop_placement, v_placement, validate
from tests.support.pipeline_models import mlp_layers
from tests.support.rank_harness import run_ranks


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.sampled_from(["loop", "v"]))
def test_forward_only_schedule_is_valid_for_any_placement(p: int, m: int, shape: str) -> None:
    placement = loop_placement(p, 2) if shape == "loop" else v_placement(p)
    schedule = forward_only_schedule(tuple(placement), m, p)
    validate(schedule)
    assert not schedule.has_backward


def test_forward_only_schedule_refuses_zero_microbatches() -> None:
    with pytest.raises(PipelineConfigError, match="num_microbatches"):
        forward_only_schedule((0, 1), 0, 2)


def _check(rank: int, world_size: int) -> None:
    inputs = torch.randn(6, 8)
    expected = reference_forward(build_reference(mlp_layers()), inputs)
    for schedule, chunks in (("1f1b", 1), ("zb-v", 2)):
        module = PipelineModule(mlp_layers(), num_stages=world_size, chunks=chunks)
        engine = PipelineEngine(module, schedule=schedule, num_microbatches=4, timeout=30)
        inference = Inference(engine)
        for m in (1, 3, 6):
            out = inference.eval_batch(inputs, num_microbatches=m, broadcast=True)
            torch.testing.assert_close(out, expected)  # on every rank
        local = inference.eval_batch(inputs, num_microbatches=3)
        assert (local is not None) == engine.is_last_stage()


@pytest.mark.multiprocess
def test_eval_with_its_own_microbatches_broadcasts_the_outputs() -> None:
    run_ranks(_check, 2)
