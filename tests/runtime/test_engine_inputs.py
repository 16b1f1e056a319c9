"""`PipelineEngine` refuses bad arguments, and user schedules (our text, torch's CSV) that
would deadlock or skip a microbatch, before it builds a layer or runs a step — on every rank,
in one launch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from pipeline import PipelineConfigError, PipelineEngine, PipelineModule, launch
from schedules import Schedule, build_schedule, parse_torch_csv
from tests.support.pipeline_models import MODELS

pytestmark = pytest.mark.multiprocess

_ONE_F_ONE_B = build_schedule("1f1b", 2, 2).format()

USER_SCHEDULES: dict[str, tuple[Callable[[], Schedule], str]] = {
    "skips microbatch 1 on stage 1": (
        lambda: Schedule.from_text("0F0 0F1 0B0 0B1\n1F0 1B0", num_microbatches=2),
        "stage 1, microbatch 1 has no ops"),
    "computes a backward before its forward": (
        lambda: Schedule.from_text("0F0 0B0\n1B0 1F0"), "deadlock"),
    "receives before it sends (lowered)": (
        lambda: Schedule.from_text(_ONE_F_ONE_B.replace("0SEND_F1@1 0RECV_B0@1",
                                                        "0RECV_B0@1 0SEND_F1@1")),
        "deadlock under blocking"),
    "runs a forward twice": (
        lambda: Schedule.from_text("0F0 0F0 0B0\n1F0 1B0"), "appears twice"),
    "torch CSV skipping microbatch 1": (
        lambda: parse_torch_csv("0F0,0F1,0B0,0B1\n1F0,1B0\n", num_microbatches=2),
        "stage 1, microbatch 1 has no ops"),
}

BAD_ARGUMENTS: dict[str, tuple[dict[str, Any], str]] = {
    "schedule a number": ({"schedule": 3}, "got 3"),
    "num_microbatches 0": ({"num_microbatches": 0}, "got 0"),
    "optimizer a name": ({"optimizer": "adam"}, "got 'adam'"),
    "topology a string": ({"topology": "2x1"}, "got '2x1'"),
    "device a string": ({"device": "cpu"}, "got 'cpu'"),
    "timeout 0": ({"timeout": 0}, "got 0"),
    "dynamic_shapes a string": ({"dynamic_shapes": "yes"}, "got 'yes'"),
    "gradient_reducer without methods": ({"gradient_reducer": 42}, "got 42"),
    "num_microbatches for another schedule": ({"schedule": "gpipe", "num_microbatches": None},
                                              "needs num_microbatches="),
}


def _module() -> PipelineModule:
    return PipelineModule(MODELS["mlp"].layers(), num_stages=2, loss_fn=MODELS["mlp"].loss)


def _refusals() -> dict[str, Any]:
    messages: dict[str, Any] = {}
    for name, (make, _) in USER_SCHEDULES.items():
        module = _module()
        try:
            PipelineEngine(module, schedule=make())
            messages[name] = "accepted"
        except (ValueError, TypeError) as error:
            messages[name] = (type(error).__name__, str(error), len(module.stages))
    for name, (kwargs, _) in BAD_ARGUMENTS.items():
        module = _module()
        try:
            PipelineEngine(module, **{"schedule": "1f1b", "num_microbatches": 2, **kwargs})
            messages[name] = "accepted"
        except (ValueError, TypeError) as error:
            messages[name] = (type(error).__name__, str(error), len(module.stages))
    try:
        PipelineEngine("model", schedule="1f1b")  # type: ignore[arg-type]
    except TypeError as error:
        messages["module a string"] = ("TypeError", str(error), 0)
    # a valid user schedule, written as text, runs
    engine = PipelineEngine(_module(), schedule=Schedule.from_text(_ONE_F_ONE_B),
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    messages["valid text runs"] = engine.train_batch(*MODELS["mlp"].batch(seed=0, batch=8))
    # regression: training without loss_fn failed mid-step on the last rank only
    lossless = PipelineEngine(PipelineModule(MODELS["mlp"].layers(), num_stages=2),
                              schedule="1f1b", num_microbatches=2)
    try:
        lossless.train_batch(*MODELS["mlp"].batch(seed=0, batch=8))
        messages["no loss_fn"] = "accepted"
    except PipelineConfigError as error:
        messages["no loss_fn"] = str(error)
    # the engine still runs after refusing (no rank was left inside a step)
    messages["after refusal"] = engine.train_batch(*MODELS["mlp"].batch(seed=1, batch=8))
    return messages


def test_engine_refuses_bad_arguments_and_broken_user_schedules_before_any_step() -> None:
    for rank, messages in enumerate(launch(_refusals, 2, timeout=20, join_timeout=120)):
        for name, (_, named) in {**USER_SCHEDULES, **BAD_ARGUMENTS}.items():
            outcome = messages[name]
            assert outcome != "accepted", f"rank {rank}: {name} was accepted"
            kind, text, built = outcome
            assert kind in ("PipelineConfigError", "TypeError"), (name, kind, text)
            assert named in text, (name, text)
            assert built == 0, f"{name}: layers were built before the refusal"
        assert "got str" in messages["module a string"][1]
        assert "loss_fn=" in messages["no loss_fn"], (rank, messages["no loss_fn"])
        assert messages["after refusal"] > 0
        assert messages["valid text runs"] > 0
