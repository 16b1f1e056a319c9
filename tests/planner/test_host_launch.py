"""The host side of a layer pass (`pipeline.planner.host_launch`): the kernels a pass launches,
counted by hand from the kernel model's kernel lists; each pass priced as the longer of its
device and host time; the term off at host_op_seconds 0; the cluster field checked."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.planner import PRESETS, PlanError, load_model
from pipeline.planner.cluster import cluster_from_json
from pipeline.planner.device_profile import (
    apply_device_profile,
    read_device_profile,
    write_device_profile,
)
from pipeline.planner.expert_kernels import block_kernel_times
from pipeline.planner.host_launch import (
    HOST_OP_SECONDS,
    host_pass_seconds,
    issue_bound_seconds,
    pass_collective_calls,
    pass_kernel_counts,
)
from pipeline.planner.kernels import KernelTimes, LayerShape
from pipeline.planner.moe_shape import RoutedExperts
from pipeline.planner.pricing import layer_split_times, layer_times, layer_tp_pass_seconds

__all__: list[str] = []

H100 = PRESETS["h100-80g"]
GPT = "layers=4,hidden=2048,heads=16,vocab=50257,seq=2048"


def _counts(shape: LayerShape, tp: int = 1) -> tuple[float, float, float]:
    counts = pass_kernel_counts(shape, 1, tp, H100, "bf16")
    return counts.forward, counts.input_grad, counts.weight_grad


def _block(**fields: object) -> LayerShape:
    return replace(LayerShape("block", 2048, 2048, 16, 2048, 8192, 50257, 2), **fields)


# The kernel lists of `kernels._block_parts` (module docstring): per pass (forward, input
# gradient, weight gradient) kernels, a norm's backward priced as 1.5 of its forward pass
# and an activation's likewise, FlashAttention's backward 2.5 of its forward kernel.
_NORMS = (2, 2 * 1.5, 0)           # two LayerNorms
_DROPOUT_ADDS = (2, 2, 0)          # two bias-dropout-adds
_LINEARS = (4, 4, 4)               # qkv, proj, fc1, fc2: one GEMM each per pass
_GELU = (1, 1.5, 0)
_FUSED_CORE = (1, 2.5, 0)
_EAGER_CORE = (2 + 2, 2 * 2 + 2, 0)  # QKᵀ, PV and two score passes; backward twice the GEMMs


def _total(*parts: tuple[float, float, float]) -> tuple[float, float, float]:
    return tuple(sum(part[i] for part in parts) for i in range(3))  # type: ignore[return-value]


def test_a_block_launches_the_kernels_the_model_prices() -> None:
    assert _counts(_block()) == _total(_NORMS, _DROPOUT_ADDS, _LINEARS, _GELU, _FUSED_CORE)
    assert _counts(_block(), tp=8) == _counts(_block())  # thinner kernels, as many
    assert _counts(_block(attention="eager")) == _total(_NORMS, _DROPOUT_ADDS, _LINEARS, _GELU,
                                                        _EAGER_CORE)
    assert _counts(_block(gated=True)) == _counts(_block())  # gate and up: one GEMM
    # Megatron-LM 2021's extra element-wise passes (`kernels._megatron_2021_block`): 2 and 7
    assert _counts(_block(engine="megatron-2021")) == _total(_counts(_block()), (2, 7, 0))


def test_embedding_and_head_counts() -> None:
    embedding = replace(_block(), role="embedding")
    assert _counts(embedding) == (2, 0, 2)  # gather (+ positions); backward scatters
    head = replace(_block(), role="head")
    # final norm, logits GEMM, cross entropy (2 kernels forward, 1 backward)
    assert _counts(head) == _total((1, 1.5, 0), (1, 1, 1), (2, 1, 0))


def test_a_moe_block_counts_one_gemm_per_local_expert() -> None:
    routed = RoutedExperts(experts=8, topk=2, expert_ffn=4096, ep=2)
    shape = _block(routed=routed, gated=True)
    attention = _total(_NORMS, _DROPOUT_ADDS, (2, 2, 2), _FUSED_CORE)  # no dense MLP
    router = (1 + 5, 1 + 3, 1)     # logits GEMM; top-k, scores (`router_times`)
    permutations = (2 + 2 + 3, 3 + 2 + 2, 0)  # 4 local experts: the two sorts run
    expert = (2 + 1, 2 + 1.5, 2)  # gate/up and down GEMMs, the activation
    experts = tuple(4 * x for x in expert)
    assert _counts(shape) == _total(attention, router, permutations, experts)  # type: ignore[arg-type]


def test_collective_calls_per_pass() -> None:
    layers = load_model(GPT).layers
    block = layers[1]
    assert block.tp_allreduces == 2
    assert pass_collective_calls(block, 1) == (0, 0)
    assert pass_collective_calls(block, 4) == (2, 2)
    parallel = load_model(GPT, sequence_parallel=True).layers[1]
    assert pass_collective_calls(parallel, 4) == (4, 6)  # RS + AG each; re-gathers
    assert parallel.shape is not None
    moe = replace(parallel, shape=replace(parallel.shape, routed=RoutedExperts(
        experts=8, topk=2, expert_ffn=4096, ep=4)))
    assert pass_collective_calls(moe, 4) == (6, 8)


def test_host_seconds_are_the_ops_at_the_cluster_figure() -> None:
    block = load_model(GPT).layers[1]
    assert block.shape is not None
    kernels = _counts(block.shape, tp=2)
    calls = pass_collective_calls(block, 2)
    host = host_pass_seconds(block, 1, 2, H100, "bf16")
    op = H100.host_op_seconds
    assert (host.forward, host.input_grad, host.weight_grad) == pytest.approx(
        ((kernels[0] + calls[0]) * op, (kernels[1] + calls[1]) * op, kernels[2] * op),
        rel=1e-12)
    off = replace(H100, host_op_seconds=0.0)
    assert host_pass_seconds(block, 1, 2, off, "bf16") == KernelTimes(0.0, 0.0, 0.0)


@pytest.mark.parametrize("op", [HOST_OP_SECONDS, 1e-3])
@pytest.mark.parametrize("tp", [1, 8])
def test_each_pass_takes_the_longer_of_device_and_host(op: float, tp: int) -> None:
    """The rule from its definition: per pass max(device, host) + the exposed collectives;
    at 1 ms an op every pass is host-bound, at the preset's 10 µs a tp-1 block is not."""
    cluster = replace(H100, host_op_seconds=op)
    block = load_model(GPT).layers[1]
    assert block.shape is not None
    device = block_kernel_times(block.shape, 1, tp, cluster, "bf16")
    kernels = _counts(block.shape, tp)
    calls = pass_collective_calls(block, tp)
    host = ((kernels[0] + calls[0]) * op, (kernels[1] + calls[1]) * op, kernels[2] * op)
    comm = layer_tp_pass_seconds(block, cluster, "bf16", 1, tp)
    forward, backward = layer_times(block, cluster, "bf16", 1, tp)
    assert forward == pytest.approx(max(device.forward, host[0]) + comm[0], rel=1e-12)
    assert backward == pytest.approx(
        max(device.input_grad + device.weight_grad, host[1] + host[2]) + comm[1], rel=1e-12)
    input_grad, weight_grad = layer_split_times(block, cluster, "bf16", 1, tp)
    assert input_grad == pytest.approx(max(device.input_grad, host[1]) + comm[1], rel=1e-12)
    assert weight_grad == pytest.approx(max(device.weight_grad, host[2]), rel=1e-12)
    if op == 1e-3:
        assert forward > device.forward + comm[0]
    elif tp == 1:
        assert forward == pytest.approx(device.forward + comm[0], rel=1e-12)


def test_the_term_off_prices_the_device_alone() -> None:
    off = replace(H100, host_op_seconds=0.0)
    on = replace(H100, host_op_seconds=1e-3)
    for layer in load_model(GPT).layers:
        assert layer.shape is not None
        device = block_kernel_times(layer.shape, 1, 8, off, "bf16")
        comm = layer_tp_pass_seconds(layer, off, "bf16", 1, 8)
        assert layer_times(layer, off, "bf16", 1, 8) == pytest.approx(
            (device.forward + comm[0], device.input_grad + device.weight_grad + comm[1]),
            rel=1e-12)
        assert layer_times(layer, on, "bf16", 1, 8)[0] > layer_times(layer, off, "bf16", 1, 8)[0]


def test_the_rule_is_the_maximum() -> None:
    assert issue_bound_seconds(3.0, 2.0) == 3.0
    assert issue_bound_seconds(2.0, 3.0) == 3.0
    assert issue_bound_seconds(2.0, 0.0) == 2.0


def test_the_cluster_field() -> None:
    assert all(cluster.host_op_seconds == HOST_OP_SECONDS for cluster in PRESETS.values())
    assert HOST_OP_SECONDS == pytest.approx((5e-6 * 20e-6) ** 0.5)  # HTA's 5-20 µs, middle
    assert cluster_from_json({"preset": "h100-80g", "host_op_seconds": 0}).host_op_seconds == 0
    for bad in (-1e-6, float("nan"), True):
        with pytest.raises(PlanError, match="host_op_seconds"):
            replace(H100, host_op_seconds=bad)


def test_a_device_profile_measures_and_sets_the_host_figure(tmp_path: Path) -> None:
    """The measurement path: `calibrate.host_op_seconds` times eager autograd ops here (a
    CPU: each op dispatches and runs a tiny kernel, microseconds, never a second), and a
    device profile that carries it sets the cluster's figure."""
    import torch

    from pipeline.planner.calibrate import host_op_seconds

    measured = host_op_seconds(torch.device("cpu"), ops=50, repeats=2)
    assert 1e-8 < measured < 1e-3
    profile = {"device": "cpu", "precision": "fp32", "gemms": [[16, 16, 16, 1e-6]],
               "memory_bandwidth": 1e10}
    path = tmp_path / "device.json"
    write_device_profile(path, {**profile, "host_op_seconds": measured})
    assert apply_device_profile(H100, path).host_op_seconds == measured
    write_device_profile(path, profile)  # an older profile: the cluster's figure stays
    assert apply_device_profile(H100, path).host_op_seconds == H100.host_op_seconds
    write_device_profile(path, {**profile, "host_op_seconds": -1})
    with pytest.raises(PlanError, match="host_op_seconds"):
        read_device_profile(path)
