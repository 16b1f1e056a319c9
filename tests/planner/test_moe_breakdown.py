"""Issue 48 / 43's defect: the breakdown booked a cross-node expert all-to-all as "bubble"
with `ep_comm 0.0 ms` where the rank that finishes last has no MoE layer of its own (a
DeepSeek-V2-shaped model's first dense blocks): it waits on the other ranks' all-to-alls.
The all-to-all is now `ep_comm` wherever it is the cause, against an oracle: the same
configuration priced with no all-to-all at all."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import pipeline.planner.predict as predict
from pipeline.planner import PRESETS, PlanConfig, load_model
from pipeline.planner.expert_parallel import exposed_all_to_all
from pipeline.planner.predict import PlanContext
from pipeline.planner.profile import ModelProfile
from pipeline.planner.rank_pricing import placement_of
from pipeline.planner.search import price

__all__: list[str] = []

DEEPSEEK_LIKE = ("layers=12,hidden=1024,heads=8,vocab=32000,seq=2048,mlp=swiglu,norm=rmsnorm,"
                 "bias=none,learned_positions=false,ffn=4096,experts=16,topk=4,expert_ffn=1024,"
                 "dense_layers=0;1;2;3")
"""Fine-grained experts (16, top 4) after dense blocks, as DeepSeek-V2 has one: four, which
the exact partitioner puts on rank 0 alone (with the embedding) at pp 4 and 8, its MoE
blocks priced per local expert (`expert_kernels`)."""
CLUSTER = replace(PRESETS["h100-80g"], nodes=8, devices_per_node=2)
"""2 devices a node: an ep group of 4 (pp 4) spans two nodes, of 2 (pp 8) one."""


def _without_all_to_all(model: ModelProfile) -> ModelProfile:
    """The same model with nothing exchanged between ep ranks (the oracle's)."""
    return replace(model, layers=tuple(replace(layer, all_to_all_bytes=0)
                                       for layer in model.layers))


@pytest.mark.parametrize("pp", [4, 8])
def test_all_to_all_a_dense_rank_waits_on_is_ep_comm_not_bubble(pp: int) -> None:
    model = load_model(DEEPSEEK_LIKE)
    dp = 16 // pp
    config = PlanConfig(pp=pp, tp=1, dp=dp, schedule="1f1b", chunks=1, microbatch_size=1,
                        num_microbatches=64 // dp, zero_stage=0, recompute="none", ep=dp)
    found = price(model, CLUSTER, 64, config)
    oracle = price(_without_all_to_all(model), CLUSTER, 64, config)
    # rank 0 (1F1B's last to finish) holds the embedding and the dense blocks only
    table = PlanContext(model, CLUSTER, 64, "bf16").table(config)
    first = np.asarray(placement_of(config)) == 0
    assert table.moe_layers[first].sum() == 0 and table.moe_layers.sum() > 0
    assert found.breakdown["ep_comm"] > 0
    assert sum(found.breakdown.values()) == pytest.approx(found.step_seconds, rel=1e-9)
    assert oracle.breakdown["ep_comm"] == 0
    # the all-to-all adds no bubble: what it delays the rank by is ep_comm
    assert found.breakdown["bubble"] == pytest.approx(oracle.breakdown["bubble"], rel=1e-6)
    assert found.breakdown["compute"] == pytest.approx(oracle.breakdown["compute"], rel=1e-9)
    busy = ("compute", "ep_comm", "bubble")
    delay = sum(found.breakdown[k] for k in busy) - sum(oracle.breakdown[k] for k in busy)
    assert found.breakdown["ep_comm"] == pytest.approx(delay, rel=1e-6)


def test_the_ranks_own_exposed_all_to_all_is_kept_where_it_is_larger() -> None:
    """A rank whose own ops carry the all-to-all (every MoE stage at pp 1) books at least
    what its own ops ran beyond their compute."""
    model = load_model(DEEPSEEK_LIKE)
    config = PlanConfig(pp=1, tp=1, dp=16, schedule="1f1b", chunks=1, microbatch_size=1,
                        num_microbatches=4, zero_stage=0, recompute="none", ep=16)
    found = price(model, CLUSTER, 64, config)
    oracle = price(_without_all_to_all(model), CLUSTER, 64, config)
    assert found.breakdown["bubble"] == pytest.approx(0.0, abs=1e-12)
    assert found.breakdown["ep_comm"] == pytest.approx(
        found.step_seconds - oracle.step_seconds, rel=1e-6)


def test_ep_comm_oracle_catches_a_planted_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    # planted: only the rank's own ops' exposed all-to-all counted (the code before the
    # fix): a dense rank's waits are booked as bubble again
    monkeypatch.setattr(predict, "exposed_all_to_all",
                        lambda timeline, model, rank, stages, without=None:
                        exposed_all_to_all(timeline, model, rank, stages))
    model = load_model(DEEPSEEK_LIKE)
    config = PlanConfig(pp=4, tp=1, dp=4, schedule="1f1b", chunks=1, microbatch_size=1,
                        num_microbatches=16, zero_stage=0, recompute="none", ep=4)
    found = price(model, CLUSTER, 64, config)
    oracle = price(_without_all_to_all(model), CLUSTER, 64, config)
    assert found.breakdown["ep_comm"] == pytest.approx(0.0, abs=1e-12)
    assert found.breakdown["bubble"] > oracle.breakdown["bubble"] * (1 + 1e-3)
