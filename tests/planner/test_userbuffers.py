"""The SMs Megatron-Core's tensor-parallel overlap takes from its GEMMs (issue 48 item 1:
tensor-parallel overlap as it actually hides the collectives, not for free): the term
against its source's numbers and the kernel model's waves, its place in the megatron-core
price, and that runs without that overlap (SC'21 Table 1) are unchanged."""

from __future__ import annotations

from dataclasses import replace

import pytest

import pipeline.planner.pricing as pricing
import pipeline.planner.userbuffers as userbuffers
from pipeline.planner import PRESETS, PlanConfig, SearchOptions, load_model
from pipeline.planner.engines import engine_options
from pipeline.planner.kernels import block_linear_times, gemm_seconds
from pipeline.planner.pricing import layer_tp_pass_seconds
from pipeline.planner.profile import LayerProfile
from pipeline.planner.search import price

__all__: list[str] = []

H100 = PRESETS["h100-80g"]
LLAMA_70B = ("layers=80,hidden=8192,heads=64,kv_heads=8,vocab=128256,seq=8192,mlp=swiglu,"
             "norm=rmsnorm,bias=none,learned_positions=false,ffn=28672,dropout=false")
NEMO_H100_TP4 = {"proj_fprop": 24, "fc2_fprop": 16, "qkv_dgrad": 4, "qkv_wgrad": 24,
                 "fc1_dgrad": 2, "fc1_wgrad": 4}
"""NeMo's `userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192`: the pipeline and bulk
overlaps' num_sm (the ring exchanges run on the copy engines)."""


def test_the_sm_counts_are_nemos_h100_recipe() -> None:
    table = userbuffers.USERBUFFERS_SMS
    assert (table["proj"][0], table["fc2"][0]) == (NEMO_H100_TP4["proj_fprop"],
                                                   NEMO_H100_TP4["fc2_fprop"])
    assert (table["qkv"][1], table["qkv"][2]) == (NEMO_H100_TP4["qkv_dgrad"],
                                                  NEMO_H100_TP4["qkv_wgrad"])
    assert (table["fc1"][1], table["fc1"][2]) == (NEMO_H100_TP4["fc1_dgrad"],
                                                  NEMO_H100_TP4["fc1_wgrad"])
    # ring exchanges: no SM
    assert table["qkv"][0] == table["fc1"][0] == table["proj"][1] == table["fc2"][1] == 0


def test_contention_is_the_gemm_on_the_sms_left() -> None:
    # by its definition: on S - n of S SMs a compute-bound GEMM takes S / (S - n) as long
    assert userbuffers.sm_contention_seconds(1.0, 132, 24) == pytest.approx(24 / 108)
    assert userbuffers.sm_contention_seconds(1.0, 132, 0) == 0.0
    with pytest.raises(ValueError, match="132"):
        userbuffers.sm_contention_seconds(1.0, 132, 132)
    # and against the kernel model's waves: the same SMs (each at 1/S of the peak), n fewer
    m, n, k = 8192, 28672 // 4, 8192
    whole = gemm_seconds(m, n, k, H100, "bf16") - H100.kernel_overhead
    left = replace(H100, sm_count=132 - 24,
                   peak_flops={"bf16": H100.peak_flops["bf16"] * (132 - 24) / 132})
    fewer = gemm_seconds(m, n, k, left, "bf16") - H100.kernel_overhead
    assert whole + userbuffers.sm_contention_seconds(whole, 132, 24) == pytest.approx(
        fewer, rel=0.03)


def _block() -> LayerProfile:
    model = load_model(LLAMA_70B, sequence_parallel=True)
    return model.layers[1]


def test_megatron_core_block_pays_the_sms_beside_its_gemms(
        monkeypatch: pytest.MonkeyPatch) -> None:
    block = _block()
    with_sms = layer_tp_pass_seconds(block, H100, "bf16", 1, 4, "megatron-core")
    plain = layer_tp_pass_seconds(block, H100, "bf16", 1, 4, "none")
    monkeypatch.setattr(pricing, "userbuffers_sms", lambda index: (0, 0, 0))
    without = layer_tp_pass_seconds(block, H100, "bf16", 1, 4, "megatron-core")
    assert block.shape is not None
    linears = [times for _, times in block_linear_times(block.shape, 1, 4, H100, "bf16")]
    qkv, proj, fc1, fc2 = linears

    def share(gemm: float, sms: int) -> float:  # the definition: g · n / (S - n)
        return gemm * sms / (132 - sms)

    forward = share(proj[0], 24) + share(fc2[0], 16)
    backward = share(qkv[1], 4) + share(qkv[2], 24) + share(fc1[1], 2) + share(fc1[2], 4)
    assert with_sms[0] - without[0] == pytest.approx(forward, rel=1e-9)
    assert with_sms[1] - without[1] == pytest.approx(backward, rel=1e-9)
    # without the overlap (megatron-2021, this engine by default) no SM is taken
    assert layer_tp_pass_seconds(block, H100, "bf16", 1, 4, "none") == plain


def test_the_term_lengthens_a_megatron_core_step_and_leaves_table_1_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = replace(H100, nodes=8)
    config = PlanConfig(pp=4, tp=4, dp=4, schedule="interleaved", chunks=5, microbatch_size=1,
                        num_microbatches=32, zero_stage=1, recompute="none")
    options = SearchOptions(**engine_options("megatron-core"))
    model = load_model(LLAMA_70B, sequence_parallel=True)
    with_sms = price(model, cluster, 128, config, options=options)
    # a 2021 run (no userbuffers) priced the same with and without the term
    gpt = load_model("layers=48,hidden=8192,heads=64,vocab=51200,seq=2048,tied_embeddings=true",
                     precision="fp16", attention="eager", engine="megatron-2021")
    table_1 = PlanConfig(pp=2, tp=8, dp=32, schedule="1f1b", chunks=1, microbatch_size=4,
                         num_microbatches=12, zero_stage=0, recompute="full")
    a100 = replace(PRESETS["a100-80g"], nodes=64)
    options_2021 = SearchOptions(**engine_options("megatron-2021"))
    before_2021 = price(gpt, a100, 1536, table_1, precision="fp16", options=options_2021)
    monkeypatch.setattr(pricing, "userbuffers_sms", lambda index: (0, 0, 0))
    without = price(model, cluster, 128, config, options=options)
    after_2021 = price(gpt, a100, 1536, table_1, precision="fp16", options=options_2021)
    assert with_sms.step_seconds > without.step_seconds * 1.01
    assert with_sms.breakdown["tp_comm"] > without.breakdown["tp_comm"]
    assert before_2021.step_seconds == after_2021.step_seconds
