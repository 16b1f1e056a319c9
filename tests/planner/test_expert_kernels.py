"""A MoE block's MLP as the engines run it (`pipeline.planner.expert_kernels`), against
oracles written here from the definitions: one GEMM per local expert on the busiest rank's
rows, the router, the permutations' bytes, the busiest rank's all-to-all, ep in the search's
stage tables, and `--routing-imbalance` refused by name when it is no load factor."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

import pipeline.planner.expert_kernels as expert_kernels
from pipeline.cli import main
from pipeline.planner import PRESETS, PlanConfig, PlanError, SearchOptions, load_model
from pipeline.planner.expert_kernels import (
    block_kernel_times,
    expert_gemm_times,
    expert_rows,
    moe_mlp_times,
    permutation_times,
    rank_load_ratio,
    routed_rows,
    router_times,
)
from pipeline.planner.expert_parallel import all_to_all_seconds, expert_all_to_all
from pipeline.planner.kernels import (
    LayerShape,
    elementwise_seconds,
    gemm_seconds,
    layer_kernel_times,
)
from pipeline.planner.predict import PlanContext
from pipeline.planner.routing_load import (
    busiest_rank_ratio,
    local_expert_variance,
    rows_distribution,
)
from pipeline.planner.search import price

__all__: list[str] = []

H100 = replace(PRESETS["h100-80g"], nodes=2)
MOE = ("layers=4,hidden=1024,heads=8,vocab=1000,seq=512,mlp=swiglu,norm=rmsnorm,bias=none,"
       "learned_positions=false,ffn=4096,experts=8,topk=2,expert_ffn=2048")
SHARED = MOE + ",shared_ffn=1536"


def _block(model: str = MOE, **routed: object) -> LayerShape:
    shape = load_model(model, sequence_parallel=True).layers[1].shape
    assert shape is not None and shape.routed is not None
    return replace(shape, routed=replace(shape.routed, **routed))


def _mlp_oracle(rows: int, width: int, h: int) -> tuple[float, float, float]:
    """A SwiGLU MLP on `rows` rows by its GEMMs' definition (Y = X·W: forward m × n × k,
    input gradient m × k × n, weight gradient k × n × m) and its fused activation (reads
    gate and up, writes one; backward 1.5×; none on no rows)."""
    def gemm(m: int, n: int, k: int) -> float:
        return gemm_seconds(m, n, k, H100, "bf16")

    act = elementwise_seconds(3 * rows * width * 2, H100) if rows else 0.0
    return (gemm(rows, 2 * width, h) + gemm(rows, h, width) + act,
            gemm(rows, h, 2 * width) + gemm(rows, width, h) + 1.5 * act,
            gemm(h, 2 * width, rows) + gemm(width, h, rows))


@pytest.mark.parametrize(("ep", "tp", "batch"), [(1, 1, 2), (2, 1, 2), (4, 2, 1), (8, 4, 4)])
def test_each_local_expert_runs_its_own_gemms_on_the_busiest_ranks_rows(
        ep: int, tp: int, batch: int) -> None:
    shape = _block(SHARED, ep=ep)
    n = math.ceil(batch * 512 / tp)  # the rank's sequence slice
    ratio = 1.0 if ep == 1 else busiest_rank_ratio(n, 2, 8, ep, tp)
    assert routed_rows(shape, batch, tp) == pytest.approx(n * 2 * ratio, rel=1e-12)
    # one local expert's rows: mean the busiest rank's over its 8/ep experts, the sampling
    # variance about the rank's mean (0 with one local expert), whole rows
    mean, local = n * 2 * ratio / (8 // ep), 8 // ep
    variance = local_expert_variance(n, 2, 8, ep)
    law = expert_rows(shape, batch, tp)
    assert law == rows_distribution(mean, variance, 64)
    assert sum(p for _, p in law) == pytest.approx(1.0, rel=1e-12)
    assert sum(r * p for r, p in law) == pytest.approx(mean, rel=1e-3)
    assert (variance == 0) == (ep == 8)
    # the 8/ep experts one after another, each at its expected time, and the shared expert
    parts = [_mlp_oracle(n, 1536, 1024)] + [
        tuple(local * p * t for t in _mlp_oracle(r, 2048, 1024)) for r, p in law]
    expected = [sum(part[i] for part in parts) for i in range(3)]
    assert expert_gemm_times(shape, batch, tp, H100, "bf16") == pytest.approx(expected,
                                                                            rel=1e-12)


MIXTRAL_8X22B = ("layers=4,hidden=6144,heads=48,kv_heads=8,vocab=32768,seq=2048,mlp=swiglu,"
                 "norm=rmsnorm,bias=none,learned_positions=false,ffn=16384,experts=8,topk=2,"
                 "expert_ffn=16384")


def _routed_expert_seconds(seq: int, ep: int, trials: int, seed: int = 5
                           ) -> tuple[float, float]:
    """(mean, standard error) over `trials` routings drawn from the definition of the busiest
    rank's experts' GEMM seconds, run one after another: ep·n tokens (n = `seq`, b 1, t 1)
    each pick 2 distinct of 8 experts, rank r holding experts 8/ep·r .. ; the rank with the
    most rows; its experts' rows about their own mean, added to the planner's busiest-rank
    mean (the expectation of its load, which it conditions on; at ep 1 the rank's load is
    n·k every time, and the rows are the drawn ones), each pushed through `gemm_seconds`."""
    shape = replace(load_model(MIXTRAL_8X22B, sequence_parallel=True).layers[1].shape,
                    seq=seq)
    assert shape.routed is not None
    shape = replace(shape, routed=replace(shape.routed, ep=ep))
    local, rng, seconds = 8 // ep, np.random.default_rng(seed), np.empty(trials)
    centre = routed_rows(shape, 1, 1) / local
    known: dict[int, float] = {}
    for trial in range(trials):
        picks = rng.random((ep * seq, 8)).argsort(axis=1)[:, :2]
        ranks = np.bincount(picks.ravel(), minlength=8).reshape(ep, local)
        mine = ranks[int(ranks.sum(axis=1).argmax())].astype(float)
        rows = np.rint(centre + mine - mine.mean()).astype(int).tolist()
        for r in rows:
            if r not in known:
                known[r] = sum(_mlp_oracle(r, 16384, 6144))
        seconds[trial] = sum(known[r] for r in rows)
    return float(seconds.mean()), float(seconds.std(ddof=1) / math.sqrt(trials))


@pytest.mark.parametrize(("seq", "ep"), [(2048, 1), (2056, 1), (2080, 1), (1040, 2)])
def test_the_experts_expected_seconds_match_a_monte_carlo_of_the_routing(
        seq: int, ep: int) -> None:
    """Mixtral-8x22B's experts (h 6144, f_e 16384) around a 512-row tile boundary: 2,048
    tokens put 512 rows on an expert on average, 2,056 and 2,080 just over it, 1,040 tokens a
    rank at ep 2 about 520 on the busiest rank's. The planner's expectation against the
    routing drawn, within 4 standard errors of the draw; the point estimate (the old price:
    every expert at its mean rows, rounded up) misses it by far more."""
    shape = replace(load_model(MIXTRAL_8X22B, sequence_parallel=True).layers[1].shape,
                    seq=seq)
    assert shape.routed is not None
    shape = replace(shape, routed=replace(shape.routed, ep=ep))
    found = sum(expert_gemm_times(shape, 1, 1, H100, "bf16"))
    mean, error = _routed_expert_seconds(seq, ep, 1500)
    assert abs(found - mean) <= 4 * error
    local = 8 // ep
    rows = math.ceil(routed_rows(shape, 1, 1) / local)
    point = local * sum(_mlp_oracle(rows, 16384, 6144))
    assert abs(point - mean) > 40 * error


def test_small_experts_lose_to_tile_quantization_a_wide_gemm_would_not() -> None:
    """Planted: the old price, one GEMM k·f_e wide on the rank's n tokens, is faster than 8
    experts of ~64 rows each, every one a partial tile and its own launch."""
    shape = _block(ep=1)
    found = expert_gemm_times(shape, 1, 4, H100, "bf16")  # n = 128 tokens, 32 rows each
    wide = _mlp_oracle(128, 2 * 2048, 1024)
    assert found[0] > 1.5 * wide[0] and found[1] > 1.5 * wide[1]
    assert found != pytest.approx(wide, rel=0.05)


def test_a_measured_imbalance_scales_the_busiest_rank_up_to_all_of_its_group() -> None:
    n = 512
    assert rank_load_ratio(_block(ep=1, imbalance=1.5).routed, n, 1) == 1.0  # type: ignore[arg-type]
    assert rank_load_ratio(_block(ep=4, imbalance=1.5).routed, n, 1) == 1.5  # type: ignore[arg-type]
    assert rank_load_ratio(_block(ep=2, imbalance=3.0).routed, n, 1) == 2.0  # type: ignore[arg-type]
    floor = rank_load_ratio(_block(ep=4).routed, n, 2)  # type: ignore[arg-type]
    assert floor == busiest_rank_ratio(n, 2, 8, 4, 2) > 1.0
    # the factor scales the experts' mean rows; their spread is the sampling floor's
    law = expert_rows(_block(ep=4, imbalance=1.5), 1, 1)
    assert sum(r * p for r, p in law) == pytest.approx(512 * 2 * 1.5 / 2, rel=1e-3)
    assert law == rows_distribution(768.0, local_expert_variance(512, 2, 8, 4), 64)
    slow = expert_gemm_times(_block(ep=4, imbalance=1.5), 1, 1, H100, "bf16")
    even = expert_gemm_times(_block(ep=4, imbalance=1.0), 1, 1, H100, "bf16")
    assert all(a > b for a, b in zip(slow, even, strict=True))


def test_router_and_permutations_are_their_kernels_bytes() -> None:
    shape = _block(ep=4)
    n, h, e, k, experts = 512, 1024, 2, 2, 8
    rows = routed_rows(shape, 1, 1)

    def stream(nbytes: float, kernels: int) -> float:
        return elementwise_seconds(nbytes, H100, kernels)

    # permutation 1 (gather n·k rows), the two chunk sorts of L rows, unpermute
    # (× probabilities, zeros, scatter-add); backward each's gradient
    forward = [2 * n * k, 2 * rows, 2 * rows, 2 * n * k + n + 2 * n * k]
    backward = [6 * n * k, 2 * rows, 2 * rows, n + 2 * n * k]
    assert permutation_times(shape, 1, 1, H100) == pytest.approx(
        (stream(sum(forward) * h * e, 7), stream(sum(backward) * h * e, 7), 0.0), rel=1e-12)
    # one local expert: no chunks to sort
    alone = _block(ep=8)
    rows = routed_rows(alone, 1, 1)
    assert permutation_times(alone, 1, 1, H100)[0] == pytest.approx(
        stream((6 * n * k + n) * h * e, 5), rel=1e-12)
    logits = [gemm_seconds(n, experts, h, H100, "bf16"), gemm_seconds(n, h, experts, H100,
                                                                      "bf16"),
              gemm_seconds(h, experts, n, H100, "bf16")]
    assert router_times(shape, 1, 1, H100, "bf16") == pytest.approx(
        (logits[0] + stream(21 * n * experts + 12 * n * k, 5),
         logits[1] + stream(20 * n * experts, 3), logits[2]), rel=1e-12)


def test_the_block_is_attention_plus_its_moe_mlp() -> None:
    shape = _block(ep=2)
    parts = [router_times(shape, 2, 2, H100, "bf16"), permutation_times(shape, 2, 2, H100),
             expert_gemm_times(shape, 2, 2, H100, "bf16")]
    assert moe_mlp_times(shape, 2, 2, H100, "bf16") == pytest.approx(
        [sum(part[i] for part in parts) for i in range(3)], rel=1e-12)
    rest = layer_kernel_times(shape, 2, 2, H100, "bf16")
    whole = block_kernel_times(shape, 2, 2, H100, "bf16")
    mlp = moe_mlp_times(shape, 2, 2, H100, "bf16")
    assert (whole.forward, whole.input_grad, whole.weight_grad) == pytest.approx(
        (rest.forward + mlp[0], rest.input_grad + mlp[1], rest.weight_grad + mlp[2]))
    dense = load_model(MOE.split(",experts")[0]).layers[1].shape
    assert dense is not None and moe_mlp_times(dense, 2, 2, H100, "bf16") == (0.0, 0.0, 0.0)


def _config(ep: int, tp: int = 1) -> PlanConfig:
    return PlanConfig(pp=2, tp=tp, dp=8 // tp, schedule="1f1b", chunks=1, microbatch_size=1,
                      num_microbatches=4, zero_stage=0, recompute="none", ep=ep)


def test_the_search_prices_each_ep_with_its_own_local_experts_and_imbalance() -> None:
    model = load_model(MOE, sequence_parallel=True)
    context = PlanContext(model, H100, 32, "bf16", routing_imbalance=1.25)
    for ep in (2, 8):
        layers = context.layers_at(ep)
        routed = [layer.shape.routed for layer in layers
                  if layer.shape is not None and layer.shape.routed is not None]
        assert len(routed) == 4 and all(r.ep == ep and r.imbalance == 1.25 for r in routed)
    two, eight = context.table(_config(2)), context.table(_config(8))
    assert two is not eight and two.stages[0][1].shape != eight.stages[0][1].shape
    assert context.table(_config(2)) is two  # kept per ep
    # the busiest rank's share of the all-to-all: the even bytes × its load ratio
    found = expert_all_to_all(two, H100, batch=1, ep=2)
    assert found is not None
    even = 512 * 2 * 1024 * 2
    per_layer = 2 * all_to_all_seconds(even * 1.25, 2, 1, H100)
    assert found.forward == pytest.approx([per_layer * 2, per_layer * 2], rel=1e-12)


def test_the_sampling_floor_is_the_default_and_a_measured_factor_slows_the_step() -> None:
    model = load_model(MOE, sequence_parallel=True)
    config = _config(4, tp=2)
    floor = price(model, H100, 16, config, options=SearchOptions())
    even = price(model, H100, 16, config, options=SearchOptions(routing_imbalance=1.0))
    skewed = price(model, H100, 16, config, options=SearchOptions(routing_imbalance=1.5))
    assert even.step_seconds < floor.step_seconds < skewed.step_seconds


def test_an_imbalance_under_planted_even_routing_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: the busiest rank priced at the mean (ratio 1): the oracle's rows differ."""
    monkeypatch.setattr(expert_kernels, "rank_load_ratio", lambda routed, tokens, tp: 1.0)
    shape = _block(ep=4)
    assert routed_rows(shape, 1, 2) != pytest.approx(256 * 2 * busiest_rank_ratio(
        256, 2, 8, 4, 2), rel=1e-6)


@pytest.mark.parametrize("value", [0.9, 0.0, float("nan"), float("inf"), True])
def test_a_routing_imbalance_that_is_no_load_factor_is_refused(value: float) -> None:
    with pytest.raises(PlanError, match=r"routing imbalance .* must be a number >= 1"):
        SearchOptions(routing_imbalance=value)


def test_the_cli_knob_prices_and_refuses_in_one_line(capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    args = ["plan", "--model", MOE, "--cluster", "h100-80g", "--global-batch", "16",
            "--sequence-parallel", "--price", "pp2,dp4,ep4"]
    assert main([*args, "--routing-imbalance", "0.5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipesched plan: error: routing imbalance 0.5 must be a number")
    assert len(err.strip().splitlines()) == 1
    assert main([*args, "--routing-imbalance", "1.3"]) == 0
    assert "ep_comm" in capsys.readouterr().out
