"""The planner's model of Megatron-LM 2021 (issue 21 item 3): only what that engine can run is
searched (uniform layer split, interleaving rules), the head's cost sits on the last stage,
blocking point-to-point messages, the fp16 gradient all-reduce and torch DDP's overlap."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from pipeline.planner import (
    PRESETS,
    PlanConfig,
    PlanError,
    SearchOptions,
    parse_shape,
    plan,
    transformer_profile,
)
from pipeline.planner.p2p import blocking_p2p
from pipeline.planner.predict import PlanContext
from pipeline.planner.pricing import allreduce_seconds
from pipeline.planner.search import price
from pipeline.planner.stages import uniform_boundaries

__all__: list[str] = []

BLOCKS = 12
SHAPE = parse_shape({"layers": BLOCKS, "hidden": 512, "heads": 8, "vocab": 32000,
                     "seq": 512})
MODEL = transformer_profile(SHAPE, "fp16", attention="eager")
CLUSTER = replace(PRESETS["a100-80g"], nodes=2)  # 16 devices, roomy for this model
BATCH = 48
RULES: dict[str, Any] = {"uniform_layers": True, "interleaved_groups": True}
EVERYTHING: dict[str, Any] = {"schedules": ("1f1b", "interleaved"), "max_chunks": 4,
                              "recompute_choices": (True,), "zero_stages": (0,),
                              "top": 10**9}  # nothing skipped by the bound: all enumerated


def megatron_can_run(config: PlanConfig) -> bool:
    """The oracle, from Megatron-LM's code of April 2021: `ParallelTransformer` asserts that
    p divides the layers and gives each model chunk l / (p·v) of them; `arguments.py` refuses
    interleaving at p <= 2; `train_step` asserts that p divides m when interleaving."""
    if BLOCKS % (config.pp * config.chunks):
        return False
    if config.schedule == "interleaved":
        return config.pp > 2 and config.num_microbatches % config.pp == 0
    return True


@pytest.fixture(scope="module")
def spaces() -> tuple[set[PlanConfig], set[PlanConfig]]:
    free = plan(MODEL, CLUSTER, BATCH, precision="fp16",
                options=SearchOptions(**EVERYTHING)).predictions
    ruled = plan(MODEL, CLUSTER, BATCH, precision="fp16",
                 options=SearchOptions(**EVERYTHING, **RULES)).predictions
    return {p.config for p in free}, {p.config for p in ruled}


def test_an_invalid_megatron_configuration_is_never_enumerated(
        spaces: tuple[set[PlanConfig], set[PlanConfig]]) -> None:
    free, ruled = spaces
    assert ruled and all(megatron_can_run(config) for config in ruled)
    # nothing the engine can run is lost: the rules only remove
    assert ruled == {config for config in free if megatron_can_run(config)}
    # and without them the planner does propose what Megatron-LM refuses (the check bites)
    refused = free - ruled
    assert any(config.schedule == "interleaved" and config.pp <= 2 for config in refused)
    assert any(BLOCKS % (config.pp * config.chunks) for config in refused)
    assert any(config.schedule == "interleaved" and config.num_microbatches % config.pp
               for config in refused)


def test_uniform_split_puts_the_embedding_first_and_the_head_on_the_last_stage() -> None:
    # embedding + 12 blocks + head; 4 stages of 3 blocks each
    assert uniform_boundaries(MODEL.layers, 4) == (0, 4, 7, 10, 14)
    assert uniform_boundaries(MODEL.layers, 5) is None
    context = PlanContext(MODEL, CLUSTER, BATCH, "fp16", uniform_layers=True)
    config = PlanConfig(pp=4, tp=1, dp=4, schedule="1f1b", chunks=1, microbatch_size=1,
                        num_microbatches=12, zero_stage=0, recompute="full")
    table = context.table(config)
    assert table.boundaries == (0, 4, 7, 10, 14)
    assert [layer.name for layer in table.stages[0]][:2] == ["embedding", "block0"]
    assert table.stages[-1][-1].name == "head"
    forward = table.costs(1).forward
    # the head's logits GEMM and loss make the last stage the slowest: its cost is there
    assert forward[-1] > forward[1] * 1.05 and forward[-1] == forward.max()
    balanced = PlanContext(MODEL, CLUSTER, BATCH, "fp16").table(config)
    assert balanced.boundaries != table.boundaries  # this engine balances instead
    assert balanced.costs(1).forward.max() < forward.max()


def test_uniform_split_refuses_stages_that_do_not_divide_the_blocks() -> None:
    config = PlanConfig(pp=5, tp=1, dp=2, schedule="1f1b", chunks=1, microbatch_size=1,
                        num_microbatches=24, zero_stage=0, recompute="full")
    cluster = replace(PRESETS["a100-80g"], nodes=1, devices_per_node=10)
    with pytest.raises(PlanError, match="5 stages do not divide"):
        PlanContext(MODEL, cluster, BATCH, "fp16", uniform_layers=True).table(config)
    with pytest.raises(PlanError, match="cannot run it"):
        price(MODEL, cluster, BATCH, config, precision="fp16",
              options=SearchOptions(**RULES))


def _two_stage() -> tuple[PlanConfig, PlanContext, PlanContext]:
    config = PlanConfig(pp=2, tp=2, dp=4, schedule="1f1b", chunks=1, microbatch_size=2,
                        num_microbatches=6, zero_stage=0, recompute="full")
    blocking = PlanContext(MODEL, CLUSTER, BATCH, "fp16", blocking_p2p=True)
    overlapped = PlanContext(MODEL, CLUSTER, BATCH, "fp16")
    return config, blocking, overlapped


def test_blocking_p2p_adds_each_message_to_its_sender_and_the_gather_to_its_receiver() -> None:
    config, blocking, _ = _two_stage()
    costs = blocking.table(config).costs(config.microbatch_size)
    cluster = replace(CLUSTER, nccl_arch="")  # α–β, as written below (NCCL's: p2p_link)
    forward, input_grad = blocking_p2p(cluster, (0, 1), tp=config.tp, devices=16,
                                       forward=costs.forward, input_grad=costs.input_grad,
                                       boundary_bytes=costs.boundary_bytes)
    # the definition: t = 2 ranks each send half the boundary over their own network card
    # (the pipeline spans nodes), then all-gather the halves over NVLink
    inter_bw, inter_lat = cluster.link(cluster.devices_per_node + 1)
    intra_bw, intra_lat = cluster.link(2)
    nbytes = costs.boundary_bytes[0]
    message = inter_lat + nbytes / 2 / inter_bw
    gather = nbytes / 2 / intra_bw + intra_lat
    assert forward == pytest.approx(costs.forward + np.array([message, gather]))
    assert input_grad == pytest.approx(costs.input_grad + np.array([gather, message]))
    assert message > 1e-5 and gather > 1e-6


def test_blocking_p2p_makes_the_step_slower() -> None:
    config, blocking, overlapped = _two_stage()
    slow = blocking.predict(config, blocking.memory(config, blocking.held_trace(config)))
    fast = overlapped.predict(config, overlapped.memory(config, overlapped.held_trace(config)))
    assert slow is not None and fast is not None
    assert slow.step_seconds > fast.step_seconds


def test_fp16_gradient_all_reduce_sends_half_the_bytes() -> None:
    config = PlanConfig(pp=1, tp=1, dp=16, schedule="1f1b", chunks=1, microbatch_size=3,
                        num_microbatches=1, zero_stage=0, recompute="full")
    exposed = {}
    for nbytes in (4.0, 2.0):
        prediction = price(MODEL, CLUSTER, BATCH, config, precision="fp16",
                           options=SearchOptions(overlap_grad_reduce=False,
                                                 grad_reduce_bytes=nbytes))
        exposed[nbytes] = prediction.breakdown["dp_comm"]
    params = MODEL.num_parameters
    for nbytes, seconds in exposed.items():
        assert seconds == pytest.approx(allreduce_seconds(params * nbytes, 16, 1, CLUSTER))
    with pytest.raises(PlanError, match="grad_reduce_bytes"):
        SearchOptions(grad_reduce_bytes=0)


def test_torch_ddp_overlaps_the_reduction_only_without_a_pipeline() -> None:
    # 600M parameters: 15 buckets of 40M, so that the reduction can hide behind a backward
    model = transformer_profile(replace(SHAPE, hidden=2048, heads=16), "fp16")

    def step(config: PlanConfig, **options: Any) -> float:
        return price(model, CLUSTER, BATCH, config, precision="fp16",
                     options=SearchOptions(**options)).step_seconds

    alone = PlanConfig(pp=1, tp=1, dp=16, schedule="1f1b", chunks=1, microbatch_size=1,
                       num_microbatches=3, zero_stage=0, recompute="full")
    piped = replace(alone, pp=2, dp=8, num_microbatches=6)
    for config in (alone, piped):
        after = step(config, overlap_grad_reduce=False)
        overlapped = step(config, overlap_grad_reduce=True)
        megatron = step(config, overlap_grad_reduce=False,
                        overlap_grad_reduce_unpipelined=True)
        assert overlapped < after
        assert megatron == (overlapped if config.pp == 1 else after)


def test_megatron_space_finds_only_runnable_picks_on_a_wide_cluster() -> None:
    # the benchmark's setting in small: Megatron's rules with blocking P2P and fp16 reduction
    options = SearchOptions(**EVERYTHING, **RULES, blocking_p2p=True, grad_reduce_bytes=2.0,
                            overlap_grad_reduce=False, overlap_grad_reduce_unpipelined=True)
    result = plan(MODEL, CLUSTER, BATCH, precision="fp16", options=options)
    assert all(megatron_can_run(p.config) for p in result.predictions)
    steps = np.array([p.step_seconds for p in result.predictions])
    assert (np.diff(steps) >= 0).all()
