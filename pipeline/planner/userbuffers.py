"""What Megatron-Core's tensor-parallel overlap (--tp-comm-overlap, Transformer Engine's
userbuffers) costs the GEMMs it hides its collectives behind: the streaming
multiprocessors its communication kernels hold while the GEMM runs.

Source: Transformer Engine runs each overlapped linear by one of three methods (TE
`transformer_engine/pytorch/module/base.py`, `initialize_ub`): "ring_exchange" (the
all-gathers of qkv_fprop, fc1_fprop, proj_dgrad, fc2_dgrad: point-to-point copies on the
copy engines, no SM), "pipeline" (the forward reduce-scatters of proj_fprop and fc2_fprop,
in `num_splits` chunks by a kernel on `num_sm` SMs; with `set_sm_margin` the GEMM is
launched on the device's SMs less those) and "bulk" (the column-parallel backward's input
all-gather beside the dgrad GEMM, qkv_dgrad and fc1_dgrad, and its input-gradient
reduce-scatter beside the wgrad GEMM, qkv_wgrad and fc1_wgrad: a kernel on `num_sm` SMs
running with the GEMM). NeMo ships the SM counts Megatron-Core's H100 recipes run with
(`nemo/collections/llm/recipes/tp_overlap_configs/userbuffers.py`,
`userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192`, the Llama-3-70B recipe's; NVIDIA/NeMo
commit 0594a700a7): `USERBUFFERS_SMS`.

Model: a GEMM is compute-bound and its throughput proportional to the SMs it runs on, so
one of g seconds on all S SMs takes g·S/(S − n) beside a kernel holding n of them:
n/(S − n)·g more (`sm_contention_seconds`). Nothing here is fitted to a measured run.
"""

from __future__ import annotations

from types import MappingProxyType

__all__ = ["USERBUFFERS_SMS", "sm_contention_seconds", "userbuffers_sms"]

USERBUFFERS_SMS: MappingProxyType[str, tuple[int, int, int]] = MappingProxyType({
    "qkv": (0, 4, 24), "proj": (24, 0, 0), "fc1": (0, 2, 4), "fc2": (16, 0, 0)})
"""Per linear of a block (qkv, proj, fc1 — gate and up —, fc2): the SMs the communication
kernel beside its (forward, input-gradient, weight-gradient) GEMM holds, from
`userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192`: proj_fprop pipeline num_sm 24, fc2_fprop
pipeline num_sm 16, qkv_dgrad bulk 4, qkv_wgrad bulk 24, fc1_dgrad bulk 2, fc1_wgrad bulk 4;
the ring exchanges (qkv_fprop, fc1_fprop, proj_dgrad, fc2_dgrad) on the copy engines: 0."""

LINEAR_NAMES = ("qkv", "proj", "fc1", "fc2")
"""`kernels.block_linear_times`' order."""


def sm_contention_seconds(gemm: float, sm_count: int, comm_sms: int) -> float:
    """Seconds a compute-bound GEMM of `gemm` seconds on all `sm_count` SMs loses when a
    communication kernel holds `comm_sms` of them beside it: gemm · n / (S − n)."""
    if comm_sms <= 0 or gemm <= 0:
        return 0.0
    if comm_sms >= sm_count:
        raise ValueError(f"a communication kernel on {comm_sms} SMs leaves none of the "
                         f"device's {sm_count} to the GEMM beside it")
    return gemm * comm_sms / (sm_count - comm_sms)


def userbuffers_sms(index: int) -> tuple[int, int, int]:
    """`USERBUFFERS_SMS` of a block's linear `index` (0..3, `LINEAR_NAMES`)."""
    return USERBUFFERS_SMS[LINEAR_NAMES[index]]
