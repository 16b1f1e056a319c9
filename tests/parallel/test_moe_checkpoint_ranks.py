"""A `save_pretrained` MoE checkpoint in small shards read at pp 2 × dp 2 × ep 2: each rank
reads exactly its stage's tensors and its ep rank's experts, steps as HF does, and the
export is what `save_pretrained` writes; a planted expert offset fails."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from pipeline.interop import hf_weights
from pipeline.interop.hf_checkpoint_reader import ExpertRows, Want
from tests.support.rank_harness import run_ranks

TOLERANCE = 1e-5


@contextmanager
def _neighbours_experts() -> Iterator[None]:
    """Planted bug: each ep rank loads the next ep rank's experts (a wrong first expert)."""
    real = hf_weights._want

    def shifted(param: torch.Tensor, fused: bool) -> tuple[Want, range | None]:
        want, kept = real(param, fused)
        rows = want.experts
        if rows is None or kept is None:
            return want, kept
        count = rows.stop - rows.first
        first = (rows.first + count) % rows.total
        return Want(want.layout, ExpertRows(first, first + count, rows.total)), kept

    hf_weights._want = shifted  # type: ignore[assignment]
    try:
        yield
    finally:
        hf_weights._want = real  # type: ignore[assignment]


def _check(rank: int, world_size: int) -> None:
    from tests.support.hf_moe_equivalence import moe_step_differences

    torch.set_num_threads(1)
    # by parameters: block 0 on stage 0, block 1 on stage 1 (uniform leaves stage 1 none)
    layout: dict[str, Any] = {"pp": 2, "dp": 2, "ep": 2, "partition_method": "parameters"}
    found = moe_step_differences("mixtral", export=True, **layout)
    assert all(found[k] <= TOLERANCE for k in ("loss", "grad", "param", "export")), found
    assert found["reads"] == found["expected_reads"], found["reads"]
    experts = {name.split(".experts.")[1].split(".")[0] for name in found["reads"]
               if ".experts." in name}
    layer = "model.layers.0." if rank < 2 else "model.layers.1."  # rank = pp_rank · dp + dp_rank
    assert {name[:len(layer)] for name in found["reads"] if ".experts." in name} == {layer}
    assert experts == ({"0", "1"} if rank % 2 == 0 else {"2", "3"}), (rank, experts)
    assert found["export_problems"] == {} and found["export_names"], found
    with _neighbours_experts():
        planted = moe_step_differences("mixtral", strict_reads=False, **layout)
    assert planted["reads"] != planted["expected_reads"]
    assert max(planted[k] for k in ("loss", "grad", "param")) > TOLERANCE, planted


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sharded_checkpoint_is_read_per_rank_and_steps_as_hf() -> None:
    """Mixtral at pp 2 × dp 2 × ep 2 from `save_pretrained(max_shard_size="20KB")`: every
    rank's reads (recorded at safetensors' get_tensor / get_slice) are its stage's names
    and its ep rank's two experts of four, each once; loss, reduced gradients and weights
    after one SGD step within 1e-5 of HF's; `save_hf_checkpoint` then loads in
    `from_pretrained` with nothing missing or unexpected, under `save_pretrained`'s names.
    Loading the other ep rank's experts fails both the read set and the step."""
    run_ranks(_check, 4, timeout=400)
