"""The supervision and launcher rooms hold no mutable module state; their pieces (fault
points, progress records, stall naming, the launcher watch) work per object and as pure
functions."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.supervision.faults import FAULT_POINTS, FaultPoints
from pipeline.supervision.orphans import EXIT_LAUNCHER_GONE, identity_of
from pipeline.supervision.progress import (
    EVERY_RANK,
    ProgressRecord,
    RankState,
    looks_like_timeout,
    name_culprit,
)

_MODULES = ["supervision.failure", "supervision.faults", "supervision.orphans",
            "supervision.progress", "launcher.processes", "launcher.results"]


@pytest.mark.parametrize("name", _MODULES)
def test_no_mutable_state_at_module_level(name: str) -> None:
    # Issue 11: the progress record, the watchdog and the armed fault points were globals
    module = importlib.import_module(f"pipeline.{name}")
    shared = {key: type(value).__name__ for key, value in vars(module).items()
              if not key.startswith("__") and key != "__all__"
              and isinstance(value, list | dict | set | bytearray | FaultPoints | ProgressRecord)}
    assert not shared, f"pipeline.{name} holds mutable state: {shared}"


def test_fault_points_of_two_owners_are_independent() -> None:
    fired: list[str] = []
    first, second = FaultPoints(), FaultPoints()
    first.arm("checkpoint.file", lambda: fired.append("first"), skip=1)
    second.reach("checkpoint.file")
    first.reach("checkpoint.file")
    assert fired == [] and first.armed == ("checkpoint.file",)
    first.reach("checkpoint.file")
    assert fired == ["first"] and first.armed == ()


def test_fault_points_refuse_bad_arguments() -> None:
    points = FaultPoints()
    with pytest.raises(ValueError, match=r"unknown fault point 'checkpoint\.nope'"):
        points.arm("checkpoint.nope", lambda: None)
    with pytest.raises(ValueError, match="skip must be an int >= 0, got -1"):
        points.arm(FAULT_POINTS[0], lambda: None, skip=-1)
    with pytest.raises(TypeError, match="action must be callable"):
        points.arm(FAULT_POINTS[0], "kill")  # type: ignore[arg-type]


def _state(waiting_on: int | None, phase: str = "train_batch of step 3") -> RankState:
    return RankState(phase, "1F2" if waiting_on is None else None, waiting_on, 7)


def test_a_silent_rank_at_the_end_of_the_waits_is_named() -> None:
    stall = name_culprit({2: _state(1), 3: _state(2)}, [0, 1, 2, 3], 0, 3, 2.0)
    assert stall.culprit == 1
    assert "rank 1 stopped progressing" in stall.explanation and "0 -> 3 -> 2 -> 1" in \
        stall.explanation


def test_a_busy_rank_at_the_end_of_the_waits_is_named() -> None:
    stall = name_culprit({1: _state(2), 2: _state(None)}, [0, 1, 2], 0, 1, 2.0)
    assert stall.culprit == 2 and "it is in 1F2 (train_batch of step 3)" in stall.explanation


def test_in_a_collective_the_rank_that_has_not_reached_it_is_named() -> None:
    answers = {0: _state(EVERY_RANK, "save_checkpoint"),
               1: _state(None, "between steps, after step 3"), 2: _state(EVERY_RANK,
                                                                        "save_checkpoint")}
    stall = name_culprit(answers, [0, 1, 2, 3], 3, None, 2.0)
    assert stall.culprit == 1
    assert stall.explanation == ("rank 1 has not reached save_checkpoint: it is in 1F2 "
                                 "(between steps, after step 3)")


def test_waits_in_a_cycle_name_nobody() -> None:
    assert name_culprit({1: _state(2), 2: _state(1)}, [0, 1, 2], 0, 1, 2.0).culprit is None


@given(st.integers(2, 6).flatmap(lambda n: st.tuples(
    st.just(n), st.integers(0, n - 1), st.one_of(st.none(), st.integers(0, n - 1)),
    st.dictionaries(st.integers(0, n - 1), st.one_of(st.none(), st.just(EVERY_RANK),
                                                     st.integers(0, n - 1))))))
def test_the_named_rank_is_another_rank_of_the_job(
        case: tuple[int, int, int | None, dict[int, int | None]]) -> None:
    n, me, waited_for, waits = case
    answers = {rank: _state(wait) for rank, wait in waits.items() if rank != me}
    stall = name_culprit(answers, list(range(n)), me, waited_for, 1.0)
    assert stall.culprit is None or (0 <= stall.culprit < n and stall.culprit != me)
    silent = [r for r in range(n) if r != me and r not in answers]
    if waited_for is None and silent:
        assert stall.culprit == silent[0]  # a rank that answers nothing is named first


def test_progress_marks_advance_with_every_phase_and_instruction() -> None:
    record = ProgressRecord(rank=2)
    record.enter("save_checkpoint", collective=True)
    assert record.snapshot() == RankState("save_checkpoint", None, EVERY_RANK, 1)
    record.execute("2F0")
    assert record.snapshot() == RankState("save_checkpoint", "2F0", None, 2)  # busy
    record.wait_on(1)
    assert record.snapshot() == RankState("save_checkpoint", "2F0", 1, 2)


def test_gloo_and_store_timeouts_are_recognised_through_causes() -> None:
    gloo = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms "
                        "for recv operation to complete")
    wrapped = ValueError("step failed")
    wrapped.__cause__ = gloo
    assert looks_like_timeout(wrapped)
    assert not looks_like_timeout(RuntimeError("Connection closed by peer"))


def test_a_process_that_exited_is_not_taken_for_a_live_launcher() -> None:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    assert identity_of(int(child.stdout)).started is None
    assert identity_of(os.getpid()).started is not None


def test_a_rank_ends_and_removes_the_launchers_directories_when_the_launcher_dies(
        tmp_path: Path) -> None:
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    owned = tmp_path / "owned"
    (owned / "inside").mkdir(parents=True)
    rank_code = textwrap.dedent(f"""
        import time
        from pipeline.supervision.orphans import identity_of, watch_launcher
        watch_launcher(identity_of({launcher.pid}), [{str(owned)!r}])
        print("watching", flush=True)
        time.sleep(600)
    """)
    rank = subprocess.Popen([sys.executable, "-c", rank_code], stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    try:
        assert rank.stdout is not None and rank.stdout.readline() == b"watching\n"
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=60)
        assert rank.wait(timeout=60) == EXIT_LAUNCHER_GONE
        assert not owned.exists()
    finally:
        for process in (launcher, rank):
            if process.poll() is None:
                process.kill()
                process.wait(timeout=60)
