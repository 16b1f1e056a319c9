"""The planner's activation model against Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models"): table 2's per-layer formulas with and without
sequence parallelism and selective recomputation, section 4.3's first and last stage extras,
and the first stage's total under 1F1B, each written here from the paper."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeline.planner import (
    PRESETS,
    ModelProfile,
    PlanConfig,
    PlanContext,
    parse_shape,
    transformer_profile,
)

__all__: list[str] = []

# the paper's notation: s sequence, b microbatch (1 here: per sample), h hidden, a heads, t
# tensor parallel, v vocabulary, L layers, p pipeline stages; 16-bit activations, eager
# attention (its 5as²b of scores, softmax and dropout mask)
S, H, A, V, L = 2048, 1024, 16, 51200, 24
SHAPE = parse_shape(f"layers={L},hidden={H},heads={A},vocab={V},seq={S}")


def _profile(sequence_parallel: bool) -> ModelProfile:
    return transformer_profile(SHAPE, "fp16", attention="eager",
                               sequence_parallel=sequence_parallel)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_table_2_per_layer(t: int) -> None:
    sbh, scores = S * H, 5 * A * S / H
    plain, parallel = _profile(False), _profile(True)
    block, sp_block = plain.layers[1], parallel.layers[1]
    # tensor parallelism: sbh(10 + 24/t + 5as/(ht))
    assert block.held(t) == pytest.approx(sbh * (10 + 24 / t + scores / t), rel=1e-12)
    # tensor + sequence parallelism: sbh(34/t + 5as/(ht))
    assert sp_block.held(t) == pytest.approx(sbh * (34 / t + scores / t), rel=1e-12)
    # tensor parallelism + selective recomputation: sbh(10 + 24/t)
    assert block.held_selective(t) == pytest.approx(sbh * (10 + 24 / t), rel=1e-12)
    # tensor + sequence parallelism + selective recomputation: sbh · 34/t
    assert sp_block.held_selective(t) == pytest.approx(sbh * 34 / t, rel=1e-12)
    # full recomputation: the layer's input, 2sbh (1/t of it under sequence parallelism)
    assert block.kept_input(t) == 2 * sbh
    assert sp_block.kept_input(t) == pytest.approx(2 * sbh / t, rel=1e-12)


@pytest.mark.parametrize("t", [1, 2, 8])
def test_first_and_last_stage_extras(t: int) -> None:
    sbh = S * H
    parallel, plain = _profile(True), _profile(False)
    embedding, head = parallel.layers[0], parallel.layers[-1]
    # section 4.3: the input embedding's dropout mask, sbh/t (per microbatch) with sequence
    # parallelism; the output layer's 4sbh/t · (1 + v/h): norm and projection inputs and
    # the fp32 logits of the cross entropy
    assert embedding.held(t) == pytest.approx(sbh / t, rel=1e-12)
    assert head.held(t) == pytest.approx(4 * sbh / t * (1 + V / H), rel=1e-12)
    # without sequence parallelism the mask and the two inputs stay whole on each tp rank
    assert plain.layers[0].held(t) == sbh
    assert plain.layers[-1].held(t) == pytest.approx(4 * sbh + 4 * S * V / t, rel=1e-12)


def test_first_stage_total_under_1f1b_is_korthikantis() -> None:
    # section 4.3: 1F1B's first stage holds p microbatches of L/p layers, sbhL/t (34 +
    # 5as/h) whatever p, plus the embedding's dropout mask of each, p · sbh/t
    p, t, m = 4, 2, 8
    model = _profile(True)
    context = PlanContext(model, replace(PRESETS["a100-80g"], nodes=1), m, "fp16",
                          uniform_layers=True)
    config = PlanConfig(pp=p, tp=t, dp=1, schedule="1f1b", chunks=1, microbatch_size=1,
                        num_microbatches=m, zero_stage=0, recompute="none")
    trace = context.held_trace(config)
    assert trace is not None
    first_rank = trace.peak_bytes(context.table(config).held)[0]
    sbh = S * H
    assert first_rank == pytest.approx(sbh * L / t * (34 + 5 * A * S / H) + p * sbh / t,
                                       rel=1e-12)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_without_dropout_no_masks_and_the_loss_keeps_its_softmax_under_full(
        sequence_parallel: bool) -> None:
    t, sbh = 2, S * H
    shape = replace(SHAPE, dropout=False)
    model = transformer_profile(shape, "fp16", attention="eager",
                                sequence_parallel=sequence_parallel)
    with_masks = _profile(sequence_parallel)
    # the paper's two 1-byte dropout masks of sbh per layer, and the embedding's, are gone;
    # the 5as²b term keeps its own mask of the scores only with dropout: as²b fewer
    split = 1 / t if sequence_parallel else 1.0
    assert model.layers[1].held(t) == pytest.approx(
        with_masks.layers[1].held(t) - 2 * sbh * split - A * S * S / t, rel=1e-12)
    assert model.layers[0].held(t) == 0.0
    # full recomputation: the head keeps its input and the loss's fp32 softmax, 4sv/t
    head = model.layers[-1]
    assert head.kept_input(t) == pytest.approx(2 * sbh * split + 4 * S * V / t, rel=1e-12)
    assert parse_shape(f"layers={L},hidden={H},heads={A},vocab={V},seq={S},"
                       "dropout=false").dropout is False
