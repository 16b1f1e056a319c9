"""A stalled rank is named within the job's timeout: SIGSTOPped mid-step (it and the ranks
waiting behind it answer no probe), slow in engine set-up, slow before `save_checkpoint`;
`pipesched train`'s timeout reaches the engine."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch.distributed as dist

from pipeline import RankFailedError, launch
from pipeline.demo.language_model import TinyLMConfig
from pipeline.demo.train_job import TrainConfig, train_rank
from tests.support.cli_helpers import call_cli
from tests.support.fault_helpers import record_pid, surviving_ranks
from tests.support.stall_scenarios import STALLS, run_stall

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("where", list(STALLS))
def test_a_stalled_rank_is_named_not_the_rank_that_timed_out(where: str, tmp_path: Path) -> None:
    # regression: "rank 1 did not answer (chain of waits: )" blamed a waiting rank
    outcome = run_stall(where, str(tmp_path))
    assert outcome.named, outcome.error
    assert outcome.clean, outcome.error


def _train_recorded(config: TrainConfig, pids: str) -> object:
    record_pid(pids)
    return train_rank(config)


def _stop_rank_one(pids: str, stop: threading.Event) -> None:
    pid_file = Path(pids, "1.pid")
    while not stop.is_set() and not pid_file.exists():
        time.sleep(0.05)
    if not stop.wait(4.0):  # a few steps in: the ranks are mid-step, in the engine's waits
        os.kill(int(pid_file.read_text()), signal.SIGSTOP)


def test_train_passes_its_timeout_to_the_engine(tmp_path: Path) -> None:
    # regression: `train` passed its timeout to launch only, so a rank stopped mid-step held
    # the others in the engine's receives for its default 300 s
    pids = str(tmp_path / "pids")
    config = TrainConfig(stages=2, microbatches=2, steps=100_000, batch_size=4, progress=False,
                         model=TinyLMConfig(width=16, blocks=2, seq_len=8, heads=2),
                         timeout=5.0)
    stop = threading.Event()
    stopper = threading.Thread(target=_stop_rank_one, args=(pids, stop), daemon=True)
    stopper.start()
    try:
        with pytest.raises(RankFailedError) as caught:
            launch(_train_recorded, 2, config, pids, timeout=config.timeout, join_timeout=200,
                   grace=2.0)
    finally:
        stop.set()
        stopper.join()
    assert "join_timeout" not in str(caught.value)  # the 5 s timeout ended it, not the bound
    assert caught.value.rank == 1, str(caught.value)
    assert not surviving_ranks(pids)


def test_train_config_refuses_a_bad_timeout() -> None:
    with pytest.raises(ValueError, match="timeout must be a finite number of seconds > 0"):
        replace(TrainConfig(), timeout=0)


@pytest.mark.parametrize("value", ["0", "-3", "nan", "soon"])
def test_train_refuses_a_timeout_that_is_not_a_positive_number(value: str) -> None:
    result = call_cli("train", "--timeout", value)
    assert result.returncode == 2 and "--timeout" in result.stderr, result.stderr


def _rank() -> int:
    return dist.get_rank()


def test_launch_still_returns_every_rank_result() -> None:
    assert launch(_rank, 2, timeout=30, join_timeout=120) == [0, 1]
