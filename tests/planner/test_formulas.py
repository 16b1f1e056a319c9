"""The transformer formulas against the papers' closed forms, and shape parsing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.planner import PlanError, TransformerShape, parse_shape, transformer_profile

__all__: list[str] = []

shapes = st.builds(
    lambda layers, head_size, heads, vocab, seq: TransformerShape(
        layers=layers, hidden=head_size * heads, heads=heads, vocab=vocab, seq=seq),
    st.integers(1, 96), st.sampled_from([8, 64, 128]), st.integers(1, 64),
    st.integers(1, 60000), st.integers(1, 8192))


def test_gpt3_parameter_count_matches_narayanan_eq2() -> None:
    # GPT-3 175B (Brown et al. 2020): l=96, h=12288, a=96, V=51200 in Megatron, s=2048
    shape = TransformerShape(layers=96, hidden=12288, heads=96, vocab=51200, seq=2048,
                             tied_embeddings=True)
    layers, h, v, s = 96, 12288, 51200, 2048
    narayanan = 12 * layers * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * layers * h))
    final_norm = 2 * h  # not in eq. (2)
    assert shape.num_parameters() - final_norm == pytest.approx(narayanan, rel=1e-12)
    assert 174e9 < shape.num_parameters() < 176e9


@settings(max_examples=40, deadline=None)
@given(shapes)
def test_flops_per_token_is_narayanans_forward(shape: TransformerShape) -> None:
    n, h, s, v = shape.layers, shape.hidden, shape.seq, shape.vocab
    # Narayanan et al. 2021 §5.1: 72Bslh²(1 + s/6h) + 6BshV per step without recomputation
    # is 3 passes of 24lh² + 4lsh + 2hV per token
    assert shape.flops_per_token() == 24 * n * h * h + 4 * n * s * h + 2 * h * v
    model = transformer_profile(shape)
    assert model.flops_per_sample == pytest.approx(s * shape.flops_per_token(), rel=1e-12)


@settings(max_examples=40, deadline=None)
@given(shapes, st.sampled_from([1, 2, 4, 8]))
def test_block_activations_are_korthikantis_eq2(shape: TransformerShape, tp: int) -> None:
    s, h, a = shape.seq, shape.hidden, shape.heads
    replicated, split = shape.block_activation_bytes(2)
    # Korthikanti et al. 2022 eq. (2), per sample: sh(10 + 24/t + 5as/(ht))
    expected = s * h * (10 + 24 / tp + 5 * a * s / (h * tp))
    assert replicated + split / tp == pytest.approx(expected, rel=1e-12)


def test_grouped_query_attention_shrinks_keys_and_values() -> None:
    full = TransformerShape(layers=2, hidden=512, heads=8, vocab=100, seq=64)
    grouped = TransformerShape(layers=2, hidden=512, heads=8, vocab=100, seq=64, kv_heads=2)
    # K and V projections shrink from h² + h each to h·k + k, k = 2 heads × 64
    assert full.block_parameters() - grouped.block_parameters() == 2 * (512 * 384 + 384)
    assert grouped.flops_per_token() < full.flops_per_token()


def test_parse_shape_inline_and_mapping_agree() -> None:
    text = parse_shape("layers=4,hidden=256,heads=4,vocab=1000,seq=128,ffn=1024")
    mapping = parse_shape({"layers": 4, "hidden": 256, "heads": 4, "vocab": 1000, "seq": 64},
                          seq=128)
    assert text == mapping


@pytest.mark.parametrize(("text", "words"), [
    ("layers=4,hidden=256,heads=4,vocab=1000", "lacks ['seq']"),
    ("layers=4,hidden=256,heads=3,vocab=1000,seq=8", "must divide hidden"),
    ("layers=four,hidden=256,heads=4,vocab=1000,seq=8", "whole number"),
    ("layers=4,hidden=256,heads=4,vocab=1000,seq=8,depth=3", "unknown keys ['depth']"),
    ("layers,hidden=256", "not key=value"),
    ("layers=0,hidden=256,heads=4,vocab=1000,seq=8", "layers=0"),
])
def test_bad_shapes_name_the_problem(text: str, words: str) -> None:
    with pytest.raises(PlanError, match=words.replace("[", r"\[").replace("]", r"\]")):
        parse_shape(text)
