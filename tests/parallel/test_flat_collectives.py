"""The flat all-gather / reduce-scatter give torch's results and no deprecation warning
(torch 2.13 warned on every `all_gather_into_tensor` call: 968 lines in a 30-step tp 2 run)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pipeline.parallel.flat_collectives import all_gather_flat, reduce_scatter_flat


@pytest.fixture
def one_rank_world(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}",
                            rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_flat_collectives_warn_nothing_and_move_the_data(one_rank_world: None) -> None:
    local = torch.arange(6.0).reshape(3, 2)
    gathered, kept = torch.empty(3, 2), torch.empty(3, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # a FutureWarning would raise here
        all_gather_flat(gathered, local)
        reduce_scatter_flat(kept, local * 2)
        work = all_gather_flat(gathered, local + 1, async_op=True)
        work.wait()
    assert torch.equal(gathered, local + 1)
    assert torch.equal(kept, local * 2)


def test_the_deprecated_names_do_warn_on_this_torch(one_rank_world: None) -> None:
    # the check above can fail: on a torch that deprecates the old names, calling them warns
    if not hasattr(dist, "all_gather_single"):
        pytest.skip("this torch has no all_gather_single: the old names are current")
    with pytest.warns(FutureWarning):
        dist.all_gather_into_tensor(torch.empty(2), torch.ones(2))
