"""A tied embedding in the planner: the head's rank holds its own copy of the weight (with
gradient and optimizer state) where the first and the last stage are on different ranks, and
the copies' gradients are all-reduced between the two once a step, before the optimizer step
(Megatron-LM's embedding group; the engine's `TiedWeightSynchronizer`). Oracles written here
from that definition; planted bugs show that each check can fail."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest

from pipeline.cli import main
from pipeline.planner import PRESETS, ClusterSpec, PlanConfig, SearchOptions, parse_shape, plan
from pipeline.planner.predict import PlanContext, Prediction
from pipeline.planner.profile import LayerProfile, ModelProfile
from pipeline.planner.report import gap_parts
from pipeline.planner.runtime_memory import NCCL_CONNECTION_BYTES
from pipeline.planner.search import price
from pipeline.planner.transformer_layers import transformer_profile

__all__: list[str] = []

TIED = 2_000_000
"""Parameters of the tied weight (split over tp): the embedding's, re-used by the head."""
POSITIONS = 1_000_000
"""A position table on the first stage, replicated: the embedding's rank has the most
parameters, so it steps longest and finishes last."""
BLOCK = LayerProfile(name="block", params_split=100_000, params_replicated=64, flops_split=4e9,
                     held_replicated=1e5, input_bytes=4096, output_bytes=4096)


def _model(tied: bool) -> ModelProfile:
    """Embedding, six equal blocks and a head whose activations dominate (its rank holds the
    most memory wherever it is); `tied` False is the twin with the head's own weight."""
    embedding = LayerProfile(name="embedding", params_split=TIED, params_replicated=POSITIONS,
                             flops_split=1e6, output_bytes=4096)
    head = LayerProfile(name="head", params_replicated=64, flops_split=1e9,
                        held_replicated=5e7, input_bytes=4096, output_bytes=4,
                        **({"tied_params_split": TIED} if tied else {"params_split": TIED}))
    blocks = [replace(BLOCK, name=f"block{index}") for index in range(6)]
    return ModelProfile((embedding, *blocks, head), name="tied" if tied else "untied",
                        heads=8, seq=16)


def _cluster(config: PlanConfig) -> ClusterSpec:
    """As many devices as `config` uses, 8 a node (fewer: one node of them), collectives
    priced α–β, the definition the oracles below write (NCCL's model of the same
    all-reduce: tests/planner/test_nccl_model.py)."""
    devices = config.pp * config.tp * config.dp
    return replace(PRESETS["a100-80g"], nodes=max(1, devices // 8),
                   devices_per_node=min(8, devices), nccl_arch="")


def _config(schedule: str, pp: int, tp: int, dp: int, *, chunks: int = 1, zero: int = 0
            ) -> PlanConfig:
    return PlanConfig(pp=pp, tp=tp, dp=dp, schedule=schedule, chunks=chunks, microbatch_size=1,
                      num_microbatches=8, zero_stage=zero, recompute="none")


# rank of each stage, from the schedules' definitions: 1F1B one stage a rank in order,
# interleaved a loop, zb-v a V (its first and last stage both on rank 0)
PLACEMENTS = {("1f1b", 1, 1): (0,), ("1f1b", 2, 1): (0, 1), ("1f1b", 4, 1): (0, 1, 2, 3),
              ("interleaved", 2, 2): (0, 1, 0, 1), ("zb-v", 2, 2): (0, 1, 1, 0)}


def _memory_problems(config: PlanConfig) -> list[str]:
    """The oracle: the fullest rank (the head's: its activations dominate) holds its own
    layers' parameters, plus the tied weight's TIED/t where the head's stage is not on the
    embedding's rank, at 4 bytes of weight, 4 of gradient and 8 (8/d under ZeRO-1) of Adam;
    under ZeRO-1 the engine holds the tied weight's gradient twice (its `.grad`, which the
    owners sum, beside the tied region's buffer): 4 bytes more for each of its TIED/t, the
    weight or the copy, whichever the head's rank holds."""
    found = price(_model(True), _cluster(config), 8 * config.dp, config)
    placement = PLACEMENTS[(config.schedule, config.pp, config.chunks)]
    head_rank = placement[-1]
    layers = _model(True).layers
    bounds = found.boundaries
    own = sum(layer.params_split / config.tp + layer.params_replicated
              for stage, rank in enumerate(placement) if rank == head_rank
              for layer in layers[bounds[stage]:bounds[stage + 1]])
    copy = TIED / config.tp if head_rank != placement[0] else 0.0
    adam = 8.0 / config.dp if config.zero_stage else 8.0
    second = 4 * TIED / config.tp if config.zero_stage else 0.0
    expected = {"rank": head_rank, "parameters": 4 * (own + copy),
                "gradients": 4 * (own + copy) + second, "optimizer": adam * (own + copy)}
    got = {"rank": found.memory_rank, "parameters": found.memory.parameters,
           "gradients": found.memory.gradients, "optimizer": found.memory.optimizer}
    return [f"{config.label()} {key}: {got[key]} != {value}" for key, value in expected.items()
            if not np.isclose(got[key], value, rtol=1e-12)]


def _ring_of_two(nbytes: float, cluster: ClusterSpec, inside_a_node: bool) -> float:
    """A 2-rank ring all-reduce (reduce-scatter + all-gather): each rank sends and receives
    half the bytes twice, 2 latency hops, over NVLink or the network card."""
    if inside_a_node:
        bandwidth, latency = cluster.intra_bandwidth, cluster.intra_latency
    else:
        bandwidth, latency = cluster.device_inter_bandwidth, cluster.inter_latency
    return 2 * (nbytes / 2) / (bandwidth * cluster.link_efficiency) + 2 * latency


def _time_problems(config: PlanConfig, inside_a_node: bool) -> list[str]:
    """The oracle on the step: dp = 1 (no reduction), the embedding's rank finishes its
    pipeline last and steps longest, so the tied model's step is its untied twin's (same
    stages, same parameters a rank) plus one 2-rank ring all-reduce of the copy's fp32
    gradient (TIED/t elements), which is also the breakdown's `tied_comm`."""
    cluster = _cluster(config)
    tied = price(_model(True), cluster, 8, config)
    twin = price(_model(False), cluster, 8, config)
    seconds = _ring_of_two(4.0 * TIED / config.tp, cluster, inside_a_node)
    problems = []
    if not np.isclose(tied.breakdown["tied_comm"], seconds, rtol=1e-9):
        problems.append(f"tied_comm {tied.breakdown['tied_comm']} != {seconds}")
    if not np.isclose(tied.step_seconds, twin.step_seconds + seconds, rtol=1e-9):
        problems.append(f"step {tied.step_seconds} != {twin.step_seconds} + {seconds}")
    # the same memory but the tied pair's NCCL ring (`runtime_memory`): 2 channels per
    # NVLink link inside a node, 2 for a 200 Gb/s NIC across
    ring = (24 if inside_a_node else 2) * NCCL_CONNECTION_BYTES
    if replace(tied.memory, runtime=0.0) != replace(twin.memory, runtime=0.0) \
            or tied.memory.runtime != twin.memory.runtime + ring:
        problems.append(f"memory {tied.memory} != the twin's {twin.memory} + {ring}")
    return problems


MEMORY_CASES = [
    _config("1f1b", 2, 2, 4),
    _config("1f1b", 2, 2, 4, zero=1),
    _config("interleaved", 2, 1, 4, chunks=2),
    _config("zb-v", 2, 2, 2, chunks=2, zero=1),  # V-shaped: no copy
    _config("1f1b", 1, 2, 4),  # one rank: no copy
]
TIME_CASES = [  # (config, whether the two ranks share a node)
    (_config("1f1b", 2, 2, 1), True),  # ranks 0 and 2 of one node of 4
    (_config("1f1b", 2, 8, 1), False),  # ranks 0 and 8 of two nodes of 8
]


@pytest.mark.parametrize("config", MEMORY_CASES, ids=lambda config: config.label())
def test_the_heads_rank_holds_a_copy_of_the_tied_weight_unless_it_has_the_embedding(
        config: PlanConfig) -> None:
    assert _memory_problems(config) == []


@pytest.mark.parametrize(("config", "inside"), TIME_CASES, ids=lambda x: str(x))
def test_the_tied_copies_gradients_are_all_reduced_before_the_step(
        config: PlanConfig, inside: bool) -> None:
    assert _time_problems(config, inside) == []


def test_the_all_reduce_runs_on_the_first_and_last_rank_only() -> None:
    # pp 4, dp 2: pipeline ranks 0 and 3, global ranks 0 and 6 (3·2 apart), one node of 8
    cluster = _cluster(_config("1f1b", 4, 1, 2))
    context = PlanContext(_model(True), cluster, 16, cluster.precision)
    seconds = context.update_seconds(_config("1f1b", 4, 1, 2))[2]
    one = _ring_of_two(4.0 * TIED, cluster, inside_a_node=True)
    assert seconds.tolist() == pytest.approx([one, 0.0, 0.0, one], rel=1e-12)
    # no copy where the first and the last stage share a rank
    for config in (_config("zb-v", 2, 1, 4, chunks=2), _config("1f1b", 1, 1, 8)):
        assert not context.update_seconds(config)[2].any()
    # an untied model has nothing to all-reduce
    untied = PlanContext(_model(False), cluster, 16, cluster.precision)
    assert not untied.update_seconds(_config("1f1b", 4, 1, 2))[2].any()


def test_breakdowns_with_a_tied_copy_sum_to_the_step() -> None:
    found: list[Prediction] = [price(_model(True), _cluster(config), 8 * config.dp, config)
                               for config in MEMORY_CASES]
    for prediction in found:
        assert sum(prediction.breakdown.values()) == pytest.approx(prediction.step_seconds)
    assert sum(p.breakdown["tied_comm"] > 0 for p in found) == 3  # the three with a copy


GPT = "layers=8,hidden=1024,heads=16,vocab=32000,seq=1024,tied_embeddings=true"


def test_why_slower_and_price_carry_the_tied_all_reduce(
        capsys: pytest.CaptureFixture[str]) -> None:
    # "why slower" counts tied_comm as communication: the parts still sum to the net gap
    model = transformer_profile(parse_shape(GPT))
    cluster = replace(PRESETS["a100-80g"], nodes=2)
    result = plan(model, cluster, 64, options=SearchOptions(top=60, schedules=("1f1b",)))
    pick = result.best
    tied = [p for p in result.predictions if p.breakdown["tied_comm"] > 0]
    assert tied
    for loser in tied:
        parts = gap_parts(loser, pick)
        assert sum(parts.values()) == pytest.approx(loser.step_seconds - pick.step_seconds,
                                                    abs=1e-12)
        assert parts["communication"] == pytest.approx(sum(
            loser.breakdown[key] - pick.breakdown[key]
            for key in ("tp_comm", "dp_comm", "tied_comm")), abs=1e-12)
    # --price prints it among the causes, as the planner priced it
    config = "pp2,tp2,dp4,1f1b,b1"
    assert main(["plan", "--model", GPT, "--cluster", "a100-80g", "--nodes", "2",
                 "--global-batch", "64", "--price", config]) == 0
    out = capsys.readouterr().out
    priced = price(model, cluster, 64, replace(_config("1f1b", 2, 2, 4), num_microbatches=16))
    line = next(line for line in out.splitlines() if line.strip().startswith("tied_comm"))
    assert f"{priced.breakdown['tied_comm'] * 1e3:.1f} ms" in line


_PLANTS: dict[str, tuple[str, Callable[..., object]]] = {
    "no copy": ("tied.tied_copies", lambda table, placement: np.zeros(len(table.tied))),
    "a copy even beside the embedding": ("tied.tied_copies",
                                         lambda table, placement: table.tied.copy()),
    "no all-reduce": ("rank_pricing.tied_allreduce_seconds",
                      lambda table, placement, *args, **kwargs: np.zeros(max(placement) + 1)),
}


@pytest.mark.parametrize("planted", sorted(_PLANTS))
def test_a_planted_bug_fails_the_oracles(planted: str, monkeypatch: pytest.MonkeyPatch) -> None:
    name, bug = _PLANTS[planted]
    monkeypatch.setattr(f"pipeline.planner.{name}", bug)
    problems = [problem for config in MEMORY_CASES for problem in _memory_problems(config)]
    problems += [problem for config, inside in TIME_CASES
                 for problem in _time_problems(config, inside)]
    assert problems


@pytest.mark.parametrize("zero", [0, 1])
def test_this_engine_reduces_its_tied_region_over_dp_at_step(zero: int) -> None:
    # The engine (TiedGradReducer): tied weights leave their stage's buckets and are reduced
    # over dp at STEP, after the owners' sum, exposed: an all-reduce of each owner's TIED/t
    # (ZeRO-1: a reduce-scatter, half of it). Megatron-LM reduces them with the rest.
    from pipeline.planner.pricing import allreduce_seconds

    config = _config("1f1b", 2, 2, 4, zero=zero)
    cluster = _cluster(config)
    share = 0.5 if zero else 1.0
    tied_seconds = share * allreduce_seconds(4.0 * TIED / 2, 4, 2, cluster)
    ours = PlanContext(_model(True), cluster, 32, "fp32")
    megatron = PlanContext(_model(True), cluster, 32, "fp32", tied_reduce_at_step=False)
    _, exposed, _ = ours.update_seconds(config)
    _, exposed_megatron, _ = megatron.update_seconds(config)
    # both owners (rank 0 the weight, rank 1 its copy) reduce TIED/2 at STEP
    assert exposed - exposed_megatron == pytest.approx([tied_seconds, tied_seconds])
    table = ours.table(config)
    mine, theirs = ours._reduction(config, table), megatron._reduction(config, table)
    assert mine is not None and theirs is not None
    # the buckets: stage 0's parameters include the weight, stage 1's exclude its copy; this
    # engine takes the weight out of stage 0's, Megatron-LM adds the copy to stage 1's
    held = TIED / 2
    for stage, (without, with_copy) in enumerate(
            ((table.params[0] - held, table.params[0]),
             (table.params[1], table.params[1] + held))):
        assert mine.time[stage] == pytest.approx(
            share * allreduce_seconds(4.0 * float(without), 4, 2, cluster))
        assert theirs.time[stage] == pytest.approx(
            share * allreduce_seconds(4.0 * float(with_copy), 4, 2, cluster))
