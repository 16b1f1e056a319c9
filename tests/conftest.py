"""Shared pytest settings (hypothesis profiles sized for a 2-core CI machine) and fixtures."""

import dataclasses
import os
from typing import NoReturn

import pytest
from hypothesis import HealthCheck, settings

from schedules import SCHEDULES

settings.register_profile("default", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=100, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture
def generators_that_must_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every registered generator fails if called: a refusal must come before building."""

    def built(*args: object) -> NoReturn:
        raise AssertionError(f"a generator ran with {args}: the size check came too late")

    for name, spec in list(SCHEDULES.items()):
        monkeypatch.setitem(SCHEDULES, name, dataclasses.replace(
            spec, make=built, plan=built if spec.plan is not None else None))
