"""Shared pytest settings: the test tiers (fast by default, `--tier full`), hypothesis budgets per
tier, and fixtures. docs/testing.md says what each tier covers."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import NoReturn

import pytest
from hypothesis import HealthCheck, settings

from schedules import SCHEDULES
from tests.support.tiers import TIERS, named_on_command_line, read_tier_list, tier_of

settings.register_profile("default", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=100, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
FAST_TIER_EXAMPLES = 20
"""The fast tier runs each property test with at most this many examples; the full tier runs
them again with their own budget (`@settings(max_examples=...)`, else the profile's)."""
SLOW_IN_FAST_TIER_S = 20.0
"""A fast-tier test whose call takes longer is named in the summary (a note, never a failure)."""
_TIER = pytest.StashKey[str]()
_SELECTED = pytest.StashKey[str]()
_STALE = pytest.StashKey[list[str]]()
_SLOW_IN_FAST_TIER: list[tuple[str, float]] = []
_WATCH_SLOW = [False]  # only in fast-tier runs


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--tier", choices=("fast", "full", "all"), default=None,
        help="fast (the default): every feature once, in minutes; full: the sweeps, every "
             "family x layout, kill and fault tests, and the property tests with the larger "
             "budget; all: both. Without --tier, `-m` naming `full` or a named node id "
             "(or a path holding only full-tier tests) selects regardless of tier.")


def _selected_tier(config: pytest.Config) -> str:
    chosen: str | None = config.getoption("--tier")
    if chosen is not None:
        return chosen
    return "all" if "full" in (config.getoption("-m") or "") else "fast"


def pytest_configure(config: pytest.Config) -> None:
    tier = _selected_tier(config)
    config.stash[_SELECTED] = tier
    config.stash[_STALE] = []
    _WATCH_SLOW[0] = tier == "fast"


def pytest_report_header(config: pytest.Config) -> str:
    tier = config.stash[_SELECTED]
    budget = f"at most {FAST_TIER_EXAMPLES}" if tier == "fast" else "their own budget of"
    return f"tier: {tier} (property tests: {budget} examples); docs/testing.md, --tier full|all"


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: `-m full` must see the marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tier_list = read_tier_list()
    used: set[str] = set()
    for item in items:
        nearest = next((mark.name for mark in item.iter_markers() if mark.name in TIERS), None)
        listed = tier_list.lookup(item.nodeid)
        used.update([listed[0]] if listed else [])
        tier = tier_of(set(item.keywords), nearest, item.nodeid, tier_list)
        item.stash[_TIER] = tier
        if tier == "full" and nearest != "full":
            item.add_marker(pytest.mark.full)
    whole_suite = config.args_source == pytest.Config.ArgsSource.TESTPATHS
    config.stash[_STALE] = sorted(set(tier_list.entries) - used) if whole_suite else []
    selected = config.stash[_SELECTED]
    if selected != "all":
        _deselect_other_tier(config, items, selected)
    if selected == "fast":
        for item in items:
            _cap_examples(item)


def _cap_examples(item: pytest.Item) -> None:
    """Run a property test with at most FAST_TIER_EXAMPLES examples (hypothesis keeps a test's
    settings on the function it wraps; an unknown layout leaves the test as it is)."""
    test = getattr(item, "obj", None)
    test = getattr(test, "__func__", test)  # a method's function
    own = getattr(test, "_hypothesis_internal_use_settings", None)
    if isinstance(own, settings) and own.max_examples > FAST_TIER_EXAMPLES:
        test._hypothesis_internal_use_settings = settings(  # type: ignore[union-attr]
            own, max_examples=FAST_TIER_EXAMPLES)


def _deselect_other_tier(config: pytest.Config, items: list[pytest.Item], selected: str) -> None:
    named = [(Path(config.invocation_params.dir, arg.partition("::")[0]).resolve(),
              arg.partition("::")[2]) for arg in config.args]
    by_argument: dict[int, list[pytest.Item]] = {}
    for item in items:
        for index in named_on_command_line(item.nodeid, item.path, named):
            by_argument.setdefault(index, []).append(item)
    # a named node id, or a named path with no test of the selected tier, runs as asked
    asked = {id(item) for index, group in by_argument.items()
             if named[index][1] or all(item.stash[_TIER] != selected for item in group)
             for item in group}
    keep, drop = [], []
    for item in items:
        property_test = isinstance(item, pytest.Function) and getattr(
            item.obj, "is_hypothesis_test", False)
        wanted = item.stash[_TIER] == selected or (selected == "full" and property_test)
        (keep if wanted or id(item) in asked else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _WATCH_SLOW[0] and report.when == "call" and report.duration > SLOW_IN_FAST_TIER_S \
            and "full" not in report.keywords:
        _SLOW_IN_FAST_TIER.append((report.nodeid, report.duration))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int,
                            config: pytest.Config) -> None:
    write = terminalreporter.write_line
    if config.stash[_SELECTED] == "fast":
        write("tier fast (the default); `python -m pytest -q --tier full` runs the rest "
              "(docs/testing.md)")
    for nodeid, seconds in _SLOW_IN_FAST_TIER:
        write(f"note: a fast-tier test took {seconds:.1f} s (over {SLOW_IN_FAST_TIER_S:.0f} s): "
              f"{nodeid}; make it cheaper or list it as full in tests/tiers.txt")
    if config.stash[_STALE]:
        write(f"note: tests/tiers.txt entries that name no test: {config.stash[_STALE]}")


@pytest.fixture
def generators_that_must_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every registered generator fails if called: a refusal must come before building."""

    def built(*args: object) -> NoReturn:
        raise AssertionError(f"a generator ran with {args}: the size check came too late")

    for name, spec in list(SCHEDULES.items()):
        monkeypatch.setitem(SCHEDULES, name, dataclasses.replace(
            spec, make=built, plan=built if spec.plan is not None else None))
