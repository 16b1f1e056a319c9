"""Injected faults end the whole job cleanly: a rank SIGKILLed mid-step (by itself or from
outside) or raising is named, every other rank exits non-zero, no process is left; a rank
killed while writing a checkpoint leaves the last complete one to resume from.

The rest of `tests.fault_scenarios.SCENARIOS` (a stall, kills at every other moment of a
save) run in `benchmarks/reliability_report.py`; the in-process crash tests of
`tests/checkpoint/test_files.py` cover every save moment without processes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.fault_scenarios import SCENARIOS, Scenario, run_scenario

pytestmark = pytest.mark.multiprocess

_IN_TESTS = ("rank SIGKILLs itself mid-step", "rank raises mid-step",
             "parent SIGKILLs a training rank", "rank 0 killed at checkpoint.commit")


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s.name in _IN_TESTS],
                         ids=lambda s: s.name)
def test_an_injected_fault_ends_the_job_cleanly(scenario: Scenario, tmp_path: Path) -> None:
    outcome = run_scenario(scenario, str(tmp_path))
    assert outcome.survived, "\n".join(outcome.problems)
