"""Failures end the whole job quickly and say where: a raising rank, a stalled rank."""

from __future__ import annotations

import time
from typing import Any

import pytest
from torch import nn

from pipeline import (
    PipelineEngine,
    PipelineModule,
    RankFailedError,
    launch,
)
from tests.support.pipeline_models import MODELS, Boom, Stall, mlp_layers

pytestmark = pytest.mark.multiprocess


def _layers_with(bad: nn.Module, at: int) -> list[Any]:
    layers = mlp_layers()
    layers.insert(at, bad)
    return layers


def _failing_rank(kind: str) -> None:
    # 17 layers over 4 stages (uniform: 5, 4, 4, 4): layer 11 sits in stage 2 (layers 9..12)
    bad: nn.Module = Boom(fail_on=2) if kind == "raise" else Stall(seconds=60)
    module = PipelineModule(_layers_with(bad, 11), num_stages=4, loss_fn=MODELS["mlp"].loss,
                            partition_method="uniform")
    engine = PipelineEngine(module, schedule="1f1b", num_microbatches=4, timeout=3)
    engine.train_batch(*MODELS["mlp"].batch(seed=0))


def test_a_raising_rank_stops_every_rank_and_is_named() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError) as caught:
        launch(_failing_rank, 4, "raise", timeout=10, join_timeout=60)
    elapsed = time.monotonic() - start
    error = caught.value
    assert error.rank == 2
    assert error.instruction == "2F1"  # the second forward of stage 2 raised
    assert "Boom: injected failure" in str(error)
    assert all(code != 0 for code in error.exit_codes), error.exit_codes
    assert elapsed < 30


def test_a_stalled_rank_times_out_instead_of_hanging() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError) as caught:
        launch(_failing_rank, 4, "stall", timeout=10, join_timeout=60)
    elapsed = time.monotonic() - start
    # a rank waiting (directly or through a neighbour) on the stalled rank 2 gives up after
    # the engine's 3 s timeout, asks the others what they do, and names the culprit
    assert "no data from pipeline rank" in str(caught.value)
    assert "rank 2 holds the pipeline up: it is in 2F0" in str(caught.value)
    assert all(code != 0 for code in caught.value.exit_codes)
    assert elapsed < 40
