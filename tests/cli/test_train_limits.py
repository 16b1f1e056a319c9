"""`pipesched train` refuses sizes this host cannot hold, in one line with the limit, before
any process starts or any layer is built."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

from pipeline.demo.footprint import check_footprint, estimate, host_memory_bytes
from pipeline.demo.language_model import TinyLMConfig
from tests.support.cli_helpers import REPO

_ADDRESS_SPACE = 8 * 2**30  # a regression fails with MemoryError here instead of OOM-killing


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (_ADDRESS_SPACE, _ADDRESS_SPACE))


@pytest.mark.slow
@pytest.mark.parametrize("arguments", [
    ("--seq-len", "10000000"),   # regression: grew to 23.7 GB and was killed by the kernel
    ("--batch-size", "800000000000"),  # regression: an allocator traceback (under 2^40)
    ("--width", "1000000"),  # regression: an allocator traceback
    ("--blocks", "100000"),  # regression: ran until killed
    ("--stages", "100", "--blocks", "20000"),  # regression: ran until killed (at 5,000 stages)
])
def test_huge_train_sizes_are_refused_from_the_estimate(arguments: tuple[str, ...],
                                                        tmp_path: object) -> None:
    result = subprocess.run([sys.executable, "-m", "pipeline.cli", "train", *arguments,
                             "--steps", "1", "--out", str(tmp_path)], cwd=REPO,
                            capture_output=True, text=True, timeout=120, check=False,
                            preexec_fn=_limited)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "more than the limit of" in lines[0] and "GiB" in lines[0], \
        lines


@pytest.mark.slow
def test_more_ranks_than_the_host_holds_are_refused_before_the_estimate(tmp_path: object) -> None:
    result = subprocess.run([sys.executable, "-m", "pipeline.cli", "train", "--stages", "5000",
                             "--blocks", "20000", "--steps", "1", "--out", str(tmp_path)],
                            cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
                            preexec_fn=_limited)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "would start 5,000 local processes" in lines[0], lines


def test_the_demo_defaults_fit_with_room_to_spare() -> None:
    footprint = check_footprint(TinyLMConfig(), batch_size=32, world_size=4)
    assert footprint.total < host_memory_bytes() / 4


def test_the_estimate_grows_with_every_size() -> None:
    base = estimate(TinyLMConfig(), batch_size=32, world_size=4).total
    for bigger in (dict(width=128), dict(blocks=16), dict(seq_len=64)):
        assert estimate(TinyLMConfig(**bigger), batch_size=32, world_size=4).total > base
    assert estimate(TinyLMConfig(), batch_size=64, world_size=4).total > base
    assert estimate(TinyLMConfig(), batch_size=32, world_size=8).total > base
