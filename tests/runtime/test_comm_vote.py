"""The per-step batch vote over the pipeline: which pipeline ranks refused, at any size."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pipeline.runtime.comm import Comm


@pytest.fixture
def one_rank_world(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("pp_rank", [0, 61, 62, 63, 64, 65, 127])
def test_failure_vote_names_refusing_ranks_of_64_or_more_stages(
        one_rank_world: None, pp_rank: int) -> None:
    # regression: the vote was a bitmask in one int64 that saturated at bit 62, so pipeline
    # rank 65 of a 128-stage pipeline was reported as rank 62. On one process the all-reduce
    # is the identity: this rank speaks for pipeline rank `pp_rank` of 128.
    comm = Comm(list(range(128)), torch.device("cpu"))
    values, refused = comm.agree([7, 3], failed=True, pp_rank=pp_rank)
    assert (values, refused) == ([7, 3], [pp_rank])
    assert comm.agree([0], failed=False, pp_rank=pp_rank) == ([0], [])
