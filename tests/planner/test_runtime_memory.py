"""What the runtime holds besides tensors (`runtime_memory`), against its sources' constants
written out here, in the planner's fit decision; and Megatron-LM's own memory estimator
(`theoretical_memory_usage.py`) as an oracle of the weights, optimizer and activations."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.cli import main
from pipeline.planner import PRESETS, PlanConfig, parse_shape
from pipeline.planner.engines import ENGINES
from pipeline.planner.errors import PlanError
from pipeline.planner.memory import rank_states
from pipeline.planner.predict import PlanContext
from pipeline.planner.runtime_memory import (
    NCCL_CONNECTION_BYTES,
    Communicator,
    allocator_block_bytes,
    allocator_segment_bytes,
    cublas_workspace_bytes,
    megatron_bucket_padding,
    nccl_channels,
    nccl_communicator_bytes,
    nccl_p2p_channels,
    nvls_bytes,
    runtime_bytes,
)
from pipeline.planner.search import SearchOptions, plan, price
from pipeline.planner.transformer_layers import transformer_profile

__all__: list[str] = []

MIB = 2**20
A100 = replace(PRESETS["a100-80g"], nodes=8)
H100 = replace(PRESETS["h100-80g"], nodes=8)


def test_the_allocator_rounds_as_its_source_says() -> None:
    # c10/cuda/CUDACachingAllocator.cpp: kMinBlockSize 512; kSmallSize 1 MiB -> kSmallBuffer
    # 2 MiB; below kMinLargeAlloc 10 MiB -> kLargeBuffer 20 MiB; else kRoundLarge 2 MiB
    assert [allocator_block_bytes(n) for n in (0, 1, 512, 513, 8519680)] == \
        [512, 512, 512, 1024, 8519680]
    assert [allocator_segment_bytes(n) for n in (1, MIB, MIB + 1, 10 * MIB - 1, 10 * MIB,
                                                 10 * MIB + 1)] == \
        [2 * MIB, 2 * MIB, 20 * MIB, 20 * MIB, 10 * MIB, 12 * MIB]
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="whole number of bytes"):
            allocator_block_bytes(bad)  # type: ignore[arg-type]


@given(st.integers(0, 2**40))
def test_a_block_is_the_request_rounded_up_to_512(size: int) -> None:
    block = allocator_block_bytes(size)
    assert block % 512 == 0 and size <= block < max(size, 1) + 512
    assert allocator_segment_bytes(size) >= block


def test_cublas_workspace_per_handle_and_stream() -> None:
    # CublasHandlePool.cpp: ":4096:2:16:8" by default, 4096 KiB x 8 on sm90
    assert cublas_workspace_bytes(80) == 2 * 4096 * 1024 + 8 * 16 * 1024 == 8519680
    assert cublas_workspace_bytes(90) == 32 * MIB
    assert cublas_workspace_bytes(100) == 8519680  # only 9.0 has the larger default
    with pytest.raises(ValueError, match="compute capability"):
        cublas_workspace_bytes(8)


def test_nccl_buffers_per_connection_and_channels() -> None:
    # src/init.cc: LL 8 lines x 512 threads x 8 steps x 16 B; LL128 120 x 640 x 8 x 8 B;
    # Simple 4 MiB
    assert NCCL_CONNECTION_BYTES == 524288 + 4915200 + 4194304
    # paths.cc: 2 channels per NVLink link to a peer in the node (A100 12, H100 18, A800 8),
    # a ring at most MAXCHANNELS / 2 = 32 (init.cc); over the network max(NICs a GPU,
    # ceil(NIC GB/s / 14))
    assert [nccl_channels(c, inside_node=True) for c in (A100, H100, PRESETS["a800-80g"])] \
        == [24, 32, 16]
    assert [nccl_channels(c, inside_node=False) for c in (A100, H100)] == [2, 4]
    # a send / receive peer: the per-peer count rounded up to a power of two, at most the
    # ring's rounded up (36 -> 64 capped at 32 on the H100)
    assert [nccl_p2p_channels(c, inside_node=True) for c in (A100, H100, PRESETS["a800-80g"])] \
        == [32, 32, 16]
    assert [nccl_p2p_channels(c, inside_node=False) for c in (A100, H100)] == [2, 4]
    ring = Communicator("tp", 8, 8, 1)
    assert nccl_communicator_bytes(ring, A100) == 24 * NCCL_CONNECTION_BYTES
    assert nccl_communicator_bytes(replace(ring, size=1), A100) == 0
    # NVLS on Hopper (nvls.cc): 16 channels x 2 x 128 KiB x 8 steps per head, a head a rank
    assert nvls_bytes(ring, H100) == 8 * 16 * 2 * 128 * 1024 * 8 == 256 * MIB
    assert nvls_bytes(ring, A100) == nvls_bytes(replace(ring, span=16), H100) == 0
    assert nvls_bytes(replace(ring, p2p=True), H100) == 0
    # an all-to-all over 8 H100s of a node: 7 peers x 32 channels, 2 GiB
    alltoall = Communicator("ep", 8, 8, 7, p2p=True)
    assert nccl_communicator_bytes(alltoall, H100) == 7 * 32 * NCCL_CONNECTION_BYTES


def test_each_rank_prices_the_communicators_it_uses() -> None:
    # 64 A100s, pp4 tp8 dp2 1F1B, tied embeddings on ranks 0 and 3: tp a ring in the node
    # (24 channels), dp, the pipeline's neighbours and the tied pair across nodes (2 each)
    config = PlanConfig(pp=4, tp=8, dp=2, schedule="1f1b", chunks=1, microbatch_size=1,
                        num_microbatches=8, zero_stage=0, recompute="full")
    found = runtime_bytes(A100, config, (0, 1, 2, 3), [0, 3])
    cublas, link = 2 * 8519680, NCCL_CONNECTION_BYTES
    ends = cublas + 24 * link + 2 * link + 2 * link + 2 * link
    middle = cublas + 24 * link + 2 * link + 2 * 2 * link
    assert found.tolist() == [ends, middle, middle, ends]
    # 16 H100s, pp2 tp8: 32 MiB workspaces, tp's ring in the node (32 channels) and its
    # NVLS buffers (8 heads x 32 MiB), the other stage's rank over 400 Gb/s NICs (4)
    hopper = PlanConfig(pp=2, tp=8, dp=1, schedule="1f1b", chunks=1, microbatch_size=1,
                        num_microbatches=8, zero_stage=0, recompute="full")
    each = 2 * 32 * MIB + 32 * link + 256 * MIB + 4 * link
    assert runtime_bytes(replace(H100, nodes=2), hopper, (0, 1)).tolist() == [each, each]
    # the CPU cluster has no CUDA context, cuBLAS or NCCL: its margin only (0 by default)
    local = replace(A100, compute_capability=0)
    assert runtime_bytes(local, config, (0, 1, 2, 3)).tolist() == [0.0] * 4
    margin = replace(local, memory_margin=2.0 * 2**30)
    assert runtime_bytes(margin, config, (0, 1, 2, 3)).tolist() == [2.0 * 2**30] * 4


MODEL = transformer_profile(parse_shape("layers=8,hidden=1024,heads=16,vocab=32000,seq=1024"),
                            "bf16")
CONFIG = PlanConfig(pp=2, tp=2, dp=16, schedule="1f1b", chunks=1, microbatch_size=1,
                    num_microbatches=4, zero_stage=1, recompute="none")


def test_the_breakdown_and_the_fit_decision_hold_the_runtime() -> None:
    found = price(MODEL, A100, 64, CONFIG)
    context = PlanContext(MODEL, A100, 64, "bf16")
    expected = context.runtime_bytes(CONFIG)[found.memory_rank]
    assert found.memory.runtime == expected > 0
    assert found.memory.total == pytest.approx(
        found.memory.parameters + found.memory.gradients + found.memory.optimizer
        + found.memory.activations + expected)
    # a device just large enough without the runtime's share refuses the configuration
    bare = price(MODEL, replace(A100, compute_capability=0), 64, CONFIG)
    assert bare.memory.runtime == 0.0
    tight = replace(A100, device_memory=bare.memory.total + expected / 2)
    only = SearchOptions(schedules=("1f1b",), tensor_parallel=(2,), pipeline_parallel=(2,),
                         zero_stages=(1,), recompute_choices=("none",), microbatch_sizes=(1,))
    with pytest.raises(PlanError):
        plan(MODEL, tight, 64, options=only)
    assert plan(MODEL, replace(tight, device_memory=found.memory.total), 64,
                options=only).best.config == CONFIG


def test_the_margin_is_validated_and_reaches_the_cli(capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    with pytest.raises(PlanError, match=r"memory_margin=-1\.0 must be a number >= 0"):
        replace(A100, memory_margin=-1.0)
    with pytest.raises(PlanError, match="must be below device_memory"):
        replace(A100, memory_margin=A100.device_memory)
    shape = "layers=8,hidden=1024,heads=16,vocab=32000,seq=1024"
    assert main(["plan", "--model", shape, "--cluster", "a100-80g", "--global-batch", "16",
                 "--memory-margin", "100"]) == 2
    err = capsys.readouterr().err
    assert "must be below device_memory" in err and err.count("\n") == 1
    assert main(["plan", "--model", shape, "--cluster", "a100-80g", "--global-batch", "16",
                 "--memory-margin", "1.5", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"runtime": ' in out


def test_a_device_the_runtime_fills_is_refused_naming_it() -> None:
    tiny = transformer_profile(parse_shape("layers=2,hidden=64,heads=2,vocab=128,seq=64"),
                               "bf16")
    small = replace(H100, nodes=1, device_memory=0.25 * 2**30)  # 64 MiB of cuBLAS alone
    with pytest.raises(PlanError, match="runtime holds besides tensors is the largest part"):
        plan(tiny, small, 8)
    assert plan(tiny, replace(small, compute_capability=0), 8).best.memory.runtime == 0.0


def test_megatron_core_bucket_padding_is_bounded() -> None:
    # param_layout.py: starts to 64 elements, bucket ends to lcm(dp, 128)
    assert megatron_bucket_padding(100_000_000, 10, 8) == 10 * 63 + 3 * 127
    assert megatron_bucket_padding(1, 1, 96) == 63 + 383
    with pytest.raises(ValueError, match="dp=0"):
        megatron_bucket_padding(10, 1, 0)


# Megatron-LM's estimator, megatron/training/theoretical_memory_usage.py (NVIDIA/Megatron-LM
# commit d98e8a64dd), rewritten for a dense GPT without biases or learned positions:
# attention 2h²(1 + g/a)·(q/h) = 4h², MLP 2hf, norms 2·2h a layer, a final norm 2h,
# embeddings Vh (twice untied); the most loaded shard (the first stage) holds
# (L/p of the split parameters + Vh)/t + L/p of the replicated ones (the final norm's too);
# 6 + 12/d bytes a parameter with the distributed optimizer.
SHAPE = parse_shape("layers=8,hidden=1024,heads=16,vocab=32000,seq=1024,bias=none,"
                    "learned_positions=false")


def _megatron_weights_and_optimizer(p: int, t: int, d: int) -> float:
    h, f, L, V = SHAPE.hidden, SHAPE.ffn, SHAPE.layers, SHAPE.vocab
    split = (4 * h * h + 2 * h * f) * L
    replicated = 2 * h * 2 * L + 2 * h
    shard = (split / p + V * h) / t + replicated / p
    if p == 1:  # untied: the output layer on the same shard
        shard += V * h / t
    return shard * (6 + 12 / d)


@pytest.mark.parametrize(("p", "t", "d"), [(1, 1, 8), (2, 2, 4), (4, 2, 2), (8, 1, 1)])
def test_weights_and_optimizer_against_megatrons_estimator(p: int, t: int, d: int) -> None:
    model = transformer_profile(SHAPE, "bf16", sequence_parallel=True)
    config = PlanConfig(pp=p, tp=t, dp=d, schedule="1f1b", chunks=1, microbatch_size=1,
                        num_microbatches=8, zero_stage=1, recompute="selective")
    context = PlanContext(model, replace(A100, compute_capability=0), 8 * d, "bf16",
                          uniform_layers=True)
    params = context.rank_sums(config)[0]
    states = rank_states(params, range(p), p, dp=d, zero=1,
                         state_bytes=ENGINES["megatron-core"]["state_bytes"])
    # the estimator spreads the final norm (2h) over the p stages; it sits on the last one
    final_norm = 2 * SHAPE.hidden * (6 + 12 / d)
    expected = _megatron_weights_and_optimizer(p, t, d) - (final_norm / p if p > 1 else 0.0)
    assert float(states.during[0]) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(("p", "t", "m"), [(1, 1, 4), (2, 2, 8), (4, 2, 2), (4, 4, 8)])
def test_activations_against_megatrons_estimator(p: int, t: int, m: int) -> None:
    # `compute_activation_memory` (sequence parallelism, selective recomputation, the first
    # stage): sbh(18 + 4f/h) a layer, the input ids 8sb and the embedding's dropout mask sbh
    # for each of p microbatches in flight (m/p of it when m < p), the output layer's
    # inputs and fp32 logits 4sbh(1 + V/h) at p = 1; all / t. The planner holds no token ids
    # (the engine keeps none for the backward) and adds the recomputed attention core of one
    # layer while it runs (`recompute_workspace`), which the estimator leaves out.
    s, h, f, L, V, b = SHAPE.seq, SHAPE.hidden, SHAPE.ffn, SHAPE.layers, SHAPE.vocab, 1
    model = transformer_profile(SHAPE, "bf16", sequence_parallel=True)
    config = PlanConfig(pp=p, tp=t, dp=1, schedule="1f1b", chunks=1, microbatch_size=b,
                        num_microbatches=m, zero_stage=0, recompute="selective")
    context = PlanContext(model, replace(A100, compute_capability=0), m, "bf16",
                          uniform_layers=True)
    table = context.table(config)
    first = float(context.held_trace(config).peak_bytes(table.held * b)[0]) \
        + float(table.workspace[0]) * b
    megatron = s * b * h * (18 + 4 * f / h) * L + (8 * s * b + s * b * h) * p
    if p > 1:
        megatron *= min(1, m / p)
    else:
        megatron += s * b * h * 4 * (1 + V / h)
    in_flight = min(m, p)
    workspace = model.layers[1].held(t) - model.layers[1].held_selective(t)
    expected = (megatron - 8 * s * b * in_flight) / t + workspace * b
    assert first == pytest.approx(expected, rel=1e-12)
    # the estimator prices the first stage only; with m < p the last one, holding the
    # fp32 logits, holds more (the planner prices the fullest rank)
    fullest = context.memory(config, context.held_trace(config))
    assert fullest[1] == (p - 1 if m < p else 0)


def test_a_planted_bug_fails_the_runtime_oracle(monkeypatch: pytest.MonkeyPatch) -> None:
    import pipeline.planner.runtime_memory as runtime_memory

    # one cuBLAS workspace instead of one per thread
    monkeypatch.setattr(runtime_memory, "CUBLAS_HANDLES", 1)
    with pytest.raises(AssertionError):
        test_each_rank_prices_the_communicators_it_uses()
    monkeypatch.undo()
    # a protocol's buffer (LL128) dropped from a connection
    monkeypatch.setattr(runtime_memory, "NCCL_CONNECTION_BYTES", 524288 + 4194304)
    with pytest.raises(AssertionError):
        test_each_rank_prices_the_communicators_it_uses()
