"""`launch`'s bookkeeping: every way a rank can end without a usable result is one
`RankFailedError` naming the rank and the cause."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch.distributed as dist

from pipeline import PipelineConfigError, RankFailedError, launch
from pipeline.launcher.results import RankReport, Result, failure_error

_BOUND = 120.0  # join_timeout of the jobs that must end by themselves


def _os_exit_on_rank_one() -> int:
    if dist.get_rank() == 1:
        os._exit(0)
    return dist.get_rank()


def _os_exit_on_rank_one_mid_collective() -> int:
    if dist.get_rank() == 1:
        os._exit(0)
    dist.barrier()  # rank 0 waits for rank 1: "Connection closed by peer"
    return dist.get_rank()


def _unpicklable_on_rank_one() -> object:
    return threading.Lock() if dist.get_rank() == 1 else 0


def _sys_exit_on_rank_one() -> int:
    if dist.get_rank() == 1:
        sys.exit(0)
    return dist.get_rank()


def _sleep_on_rank_one() -> int:
    if dist.get_rank() == 1:
        time.sleep(600)
    return dist.get_rank()


def _config_mistake_on_every_rank() -> int:
    raise PipelineConfigError("PipelineEngine: schedule '1fb1' is not a registered schedule")


@pytest.mark.multiprocess
def test_a_config_mistake_on_every_rank_is_printed_once(capfd: pytest.CaptureFixture[str]
                                                        ) -> None:
    """Regression: a typo'd schedule printed its message once per rank (37-96 lines)."""
    with pytest.raises(RankFailedError, match="schedule '1fb1'") as caught:
        launch(_config_mistake_on_every_rank, 4, timeout=30, join_timeout=_BOUND)
    printed = capfd.readouterr().err
    assert "1fb1" not in printed, printed  # the raised error says it, with a traceback
    assert str(caught.value).count("pipeline.errors.PipelineConfigError:") == 1  # one rank's
    # every rank raised it: no rank blamed (issue 49 item 8), the lowest one's details
    assert str(caught.value).startswith("every rank (4) failed with the same error: ")
    assert caught.value.rank == 0


@pytest.mark.multiprocess
def test_os_exit_zero_is_not_a_type_error() -> None:
    # regression: `TypeError: 'NoneType' object is not subscriptable`
    with pytest.raises(RankFailedError, match=r"rank 1 exited with code 0 without returning "
                                              r"a result \(did fn call os\._exit\?\)") as caught:
        launch(_os_exit_on_rank_one, 2, timeout=30, join_timeout=_BOUND)
    assert caught.value.rank == 1 and caught.value.exit_codes == (0, 0)


@pytest.mark.multiprocess
def test_a_rank_leaving_with_os_exit_zero_mid_step_is_named_not_the_survivor() -> None:
    # regression: "rank 0 failed: ... Connection closed by peer" named the survivor
    with pytest.raises(RankFailedError, match=r"rank 1 exited with code 0 without returning "
                                              r"a result .* while the others still ran"
                       ) as caught:
        launch(_os_exit_on_rank_one_mid_collective, 2, timeout=30, join_timeout=_BOUND)
    assert caught.value.rank == 1


@pytest.mark.multiprocess
def test_an_unpicklable_result_raises_instead_of_returning_error_dicts() -> None:
    # regression: launch returned [0, {'message': "rank 1's result cannot be pickled", ...}]
    with pytest.raises(RankFailedError, match=r"rank 1 failed: PipelineConfigError: rank 1's "
                                              r"result, a lock, cannot be pickled") as caught:
        launch(_unpicklable_on_rank_one, 2, timeout=30, join_timeout=_BOUND)
    assert caught.value.rank == 1 and caught.value.exit_codes[1] == 1


@pytest.mark.multiprocess
def test_join_timeout_names_the_running_rank_with_real_exit_codes() -> None:
    # regression: the error blamed rank 0 with exit codes (None, None)
    # join_timeout counts from the start: 20 s leaves a loaded machine time to start both
    # ranks (about 3 s on an idle one) without making the suite wait a minute
    with pytest.raises(RankFailedError, match=r"rank 1 was still running when "
                                              r"join_timeout=20s passed \(running: \[1\], "
                                              r"finished: \[0\]\)") as caught:
        launch(_sleep_on_rank_one, 2, timeout=30, join_timeout=20)
    assert caught.value.rank == 1
    assert caught.value.exit_codes == (0, -9)


@pytest.mark.multiprocess
def test_sys_exit_zero_on_a_rank_says_so() -> None:
    # regression: reported as "rank 1 failed: SystemExit: 0" with nothing about the call
    with pytest.raises(RankFailedError, match=r"rank 1 failed: fn called sys\.exit\(0\) on "
                                              r"rank 1 instead of returning a value") as caught:
        launch(_sys_exit_on_rank_one, 2, timeout=30, join_timeout=_BOUND)
    assert caught.value.rank == 1 and caught.value.exit_codes[1] == 1


def _error(kind: str, message: str, when: float, caused_by: int | None = None) -> Result:
    return ("error", RankReport(kind, message, when,  # type: ignore[arg-type]
                                "2F1" if caused_by is None else None, caused_by))


def test_the_launcher_blames_the_rank_that_failed_first() -> None:
    results: list[Result | None] = [_error("stopped", "stopped", 2.0, caused_by=2), None,
                                    _error("error", "Boom", 1.0), ("ok", 1)]
    failure = failure_error(results, (3, -9, 1, 0), [2], None, None)
    assert failure is not None
    assert failure.rank == 2 and failure.instruction == "2F1" and "Boom" in str(failure)


def test_a_rank_killed_first_is_blamed_before_the_errors_it_caused() -> None:
    results: list[Result | None] = [_error("error", "connection closed", 2.0), None, ("ok", 1)]
    failure = failure_error(results, (1, -9, 0), [1], None, None)
    assert failure is not None and failure.rank == 1 and "SIGKILL" in str(failure)


def test_the_rank_most_timed_out_ranks_name_is_blamed_over_the_reporters() -> None:
    results: list[Result | None] = [_error("stall", "timed out", 1.0, caused_by=2),
                                    _error("stall", "timed out", 1.5, caused_by=2),
                                    _error("stall", "timed out", 1.2, caused_by=0), None]
    failure = failure_error(results, (1, 1, 1, -9), [0], None, None)
    assert failure is not None and failure.rank == 2
    assert str(failure).startswith("rank 2 stopped progressing; rank 0 timed out waiting")


def test_a_refusal_every_rank_raised_blames_no_rank() -> None:
    """Regression: it read "rank 3 failed: ..." naming whichever rank wrote first."""
    refusal = "PipelineConfigError: tp 3 does not divide 4 heads (raised on rank 0)"
    results: list[Result | None] = [_error("error", refusal, 2.0),
                                    _error("error", refusal, 1.5), _error("error", refusal, 1.0)]
    failure = failure_error(results, (1, 1, 1), [2], None, None)
    assert failure is not None and failure.rank == 0
    assert str(failure).startswith(f"every rank (3) failed with the same error at "
                                   f"instruction 2F1: {refusal}")
    results[1] = _error("error", refusal + ".", 1.5)  # not the same on every rank: first
    failure = failure_error(results, (1, 1, 1), [2], None, None)
    assert failure is not None and failure.rank == 2 and str(failure).startswith("rank 2 failed")
    results[1] = ("ok", 1)  # one rank returned: the first to fail
    failure = failure_error(results, (1, 0, 1), [2], None, None)
    assert failure is not None and failure.rank == 2


def test_every_rank_returning_is_no_failure() -> None:
    assert failure_error([("ok", 0), ("ok", None)], (0, 0), [], None, None) is None
