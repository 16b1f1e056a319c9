"""The shape-aware device model, the network model, the device profile file and the
published-runs calibration (issue 21, items 1-3)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.planner import (
    PRESETS,
    PlanError,
    SearchOptions,
    parse_shape,
    plan,
    transformer_profile,
)
from pipeline.planner.device_profile import apply_device_profile, read_device_profile
from pipeline.planner.kernels import LayerShape, gemm_seconds, layer_kernel_times
from pipeline.planner.pricing import (
    allreduce_seconds,
    layer_times,
    ring_allreduce_seconds,
    tree_allreduce_seconds,
)

__all__: list[str] = []

A100 = PRESETS["a100-80g"]


def test_gemm_waves_quantize_the_time() -> None:
    # one tile more than a full wave of 256 × 128 tiles costs a second wave (or smaller tiles)
    sms = A100.sm_count
    full = gemm_seconds(256 * sms, 128, 4096, A100, "bf16")
    spill = gemm_seconds(256 * sms + 1, 128, 4096, A100, "bf16")
    assert spill > full * 1.05
    # a big GEMM reaches gemm_efficiency of the peak, no more
    m = n = k = 8192
    rate = 2 * m * n * k / gemm_seconds(m, n, k, A100, "bf16")
    assert rate <= A100.peak_flops["bf16"] * A100.gemm_efficiency
    assert rate >= 0.9 * A100.peak_flops["bf16"] * A100.gemm_efficiency


def test_thin_tensor_parallel_gemms_and_small_microbatches_lose_efficiency() -> None:
    shape = LayerShape("block", 2048, 4096, 32, 4096, 16384, 51200, 2)
    flops = 24 * 2048 * 4096**2  # a block's GEMM FLOPs per sample (Narayanan, section 5.1)

    def rate(batch: int, tp: int) -> float:
        return flops * batch / tp / layer_kernel_times(shape, batch, tp, A100, "bf16").forward

    assert rate(1, 8) < rate(1, 1)  # thinner GEMMs, the same element-wise work
    assert rate(1, 1) < rate(8, 1)  # more of every kernel's fixed cost per sample


def test_eager_attention_costs_more_than_fused_and_holds_the_scores() -> None:
    shape = parse_shape("layers=2,hidden=2048,heads=16,vocab=32000,seq=2048")
    eager = transformer_profile(shape, attention="eager").layers[1]
    fused = transformer_profile(shape, attention="fused").layers[1]
    assert layer_times(eager, A100, "bf16", 1, 1)[0] > layer_times(fused, A100, "bf16", 1, 1)[0]
    scores = 16 * 2048 * 2048 * 5  # Korthikanti's 5as² bytes at 16 bits
    assert eager.held_split - fused.held_split == pytest.approx(scores - 4 * 16 * 2048)


def test_sequence_parallel_splits_every_activation() -> None:
    shape = parse_shape("layers=2,hidden=1024,heads=16,vocab=32000,seq=1024")
    plain = transformer_profile(shape).layers[1]
    split = transformer_profile(shape, sequence_parallel=True).layers[1]
    assert split.held(8) == pytest.approx(plain.held(1) / 8)
    assert split.held_replicated == 0


def test_a800_tensor_parallel_is_slower_than_a100s() -> None:
    # A800: NVLink 400 GB/s (200 one way) against the A100's 600
    assert PRESETS["a800-80g"].intra_bandwidth < PRESETS["a100-80g"].intra_bandwidth
    layer = transformer_profile(parse_shape(
        "layers=2,hidden=4096,heads=32,vocab=32000,seq=2048")).layers[1]
    a800 = layer_times(layer, PRESETS["a800-80g"], "bf16", 1, 8)[0]
    assert a800 > layer_times(layer, A100, "bf16", 1, 8)[0]


def test_collectives_follow_alpha_beta_ring_and_tree() -> None:
    bandwidth, latency = 100e9, 1e-5
    # the definitions: ring 2(d-1)/d·n/β + 2(d-1)α; tree 2n/β + 2⌈log2 d⌉α
    assert ring_allreduce_seconds(1e9, 8, bandwidth, latency) == pytest.approx(
        2 * 7 / 8 * 1e9 / bandwidth + 14 * latency)
    assert tree_allreduce_seconds(8.0, 64, bandwidth, latency) == pytest.approx(
        16 / bandwidth + 12 * latency)
    # small messages take the tree, large the ring: both bound the all-reduce (the α–β
    # model, without `nccl_arch`; NCCL's: tests/planner/test_nccl_model.py)
    cluster = replace(A100, nodes=16, nccl_arch="")
    for nbytes in (1e3, 1e9):
        inside = allreduce_seconds(nbytes, 8, 1, cluster)
        bw, lat = cluster.link(8)
        assert inside == pytest.approx(min(ring_allreduce_seconds(nbytes, 8, bw, lat),
                                           tree_allreduce_seconds(nbytes, 8, bw, lat)))
    # across nodes: NVLink inside, the network cards between, dearer than inside
    assert allreduce_seconds(1e9, 16, 8, cluster) > allreduce_seconds(1e9, 8, 1, cluster)


def test_gradient_reduction_hides_behind_the_last_backward() -> None:
    # issue 21: 1.7B at t1 p1 had its whole reduction priced exposed (0.55 of 2.91 s)
    model = transformer_profile(parse_shape(
        "layers=24,hidden=2304,heads=24,vocab=51200,seq=2048"))
    cluster = replace(A100, nodes=4)
    options = {"tensor_parallel": (1,), "pipeline_parallel": (1,), "zero_stages": (0,),
               "microbatch_sizes": (4,), "recompute_choices": (False,), "top": 1}
    overlapped = plan(model, cluster, 512, options=SearchOptions(**options)).best
    after = plan(model, cluster, 512, options=SearchOptions(
        **options, overlap_grad_reduce=False)).best
    full = allreduce_seconds(model.num_parameters * 4, 32, 1, cluster)
    assert after.breakdown["dp_comm"] == pytest.approx(full)
    assert overlapped.breakdown["dp_comm"] < 0.5 * full
    assert overlapped.step_seconds < after.step_seconds


def test_profile_device_writes_what_plan_reads(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    output = tmp_path / "device.json"
    assert main(["profile-device", "--output", str(output), "--sizes", "16,64",
                 "--ranks", "1", "--repeats", "1"]) == 0
    document = read_device_profile(output)
    assert len(document["gemms"]) == 8 and document["device"] == "cpu"
    cluster = apply_device_profile(A100, output)
    m, n, k, seconds = document["gemms"][-1]
    assert gemm_seconds(m, n, k, cluster, "bf16") == pytest.approx(
        seconds + cluster.kernel_overhead)
    shape = "layers=2,hidden=64,heads=4,vocab=100,seq=16"
    assert main(["plan", "--model", shape, "--cluster", "a100-80g", "--global-batch", "8",
                 "--device-profile", str(output), "--top", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pick"]["step_seconds"] > 0
    output.write_text(json.dumps({"format": "pipesched-device-profile/1", "gemms": []}))
    with pytest.raises(PlanError, match="needs gemms"):
        read_device_profile(output)


@pytest.mark.parametrize("index", [0, 3, 6])
def test_published_rows_are_reproduced_within_ten_percent(index: int) -> None:
    from benchmarks.bench_published import ROWS, run_row

    row = ROWS[index]
    out = run_row(row, search=False)
    ratio = float(out["tflops"]) / row.tflops  # type: ignore[arg-type]
    assert math.isfinite(ratio) and abs(ratio - 1) <= 0.10, (row, ratio)
