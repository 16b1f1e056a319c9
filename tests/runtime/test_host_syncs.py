"""The training step's host synchronisations do not grow with the microbatches: no `.item()`,
`.cpu()`, `.tolist()` or tensor truth value per microbatch (each blocks on a GPU until the
queued kernels have run), only the step's own agreements (the loss, the finite vote)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from pipeline import PipelineEngine, PipelineModule, launch
from pipeline.runtime import compute_handlers
from tests.support.engine3d_models import OPTIMIZERS
from tests.support.pipeline_models import MODELS

pytestmark = pytest.mark.multiprocess

SYNCS = ("item", "cpu", "tolist", "__bool__", "__float__", "__int__")
"""Tensor methods that wait for a GPU's queued work before they return."""


def _counted_step(engine: PipelineEngine, m: int) -> Counter[str]:
    spec = MODELS["mlp"]
    inputs, targets = spec.batch(seed=0, batch=2 * m, length=1)
    counts: Counter[str] = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in SYNCS}

    def counting(name: str) -> Any:
        original = originals[name]

        def call(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return original(self, *args, **kwargs)
        return call

    for name in SYNCS:
        setattr(torch.Tensor, name, counting(name))
    try:
        engine.train_batch(inputs, targets)
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return counts


CONFIGURATIONS = (("1f1b", 0), ("zb-h1", 1))
"""(schedule, ZeRO stage): a fused and a split backward, an all-reduce and ZeRO-1."""


def _syncs_per_step() -> dict[str, dict[int, dict[str, int]]]:
    found = {f"{schedule} ZeRO-{zero}": _syncs_by_microbatches(schedule, zero)
             for schedule, zero in CONFIGURATIONS}
    # a planted bug: each stage output's finite flag read on the host as it is made
    checked = compute_handlers.all_finite
    compute_handlers.all_finite = lambda out: torch.tensor(bool(checked(out)))  # type: ignore
    try:
        found["planted"] = _syncs_by_microbatches("1f1b", 0)
    finally:
        compute_handlers.all_finite = checked
    return found


def _syncs_by_microbatches(schedule: str, zero_stage: int) -> dict[int, dict[str, int]]:
    found = {}
    for m in (2, 8):
        spec = MODELS["mlp"]
        module = PipelineModule(spec.layers(), num_stages=2, loss_fn=spec.loss)
        engine = PipelineEngine(module, schedule=schedule, num_microbatches=m,
                                optimizer=OPTIMIZERS["adam"], data_parallel=2,
                                zero_stage=zero_stage, timeout=60)
        _counted_step(engine, m)  # the first step learns shapes and builds buckets
        found[m] = dict(_counted_step(engine, m))
        engine.stop_watchdog()
    return found


def test_host_syncs_per_step_do_not_grow_with_microbatches() -> None:
    for rank, configurations in enumerate(launch(_syncs_per_step, 4, timeout=60,
                                                 join_timeout=180)):
        planted = configurations.pop("planted")
        assert planted[8] != planted[2], f"rank {rank}: the planted sync went unseen"
        for label, found in configurations.items():
            assert found[8] == found[2], f"rank {rank} {label}: {found}"
