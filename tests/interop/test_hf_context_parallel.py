"""HF Llama-shaped families with each sequence split over cp ranks inside pipeline stages
equal HF itself (loss, gradients, updated weights within 1e-5 relative, fp32, gloo), and
planted bugs in the split are caught."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from pipeline.errors import PipelineConfigError
from pipeline.interop.hf_context_parallel import context_parallel_hf
from pipeline.interop.hf_layers import layers_from_hf
from pipeline.parallel.context.sharding import check_context_parallel_sequence
from tests.support.hf_cp_equivalence import (
    PLANTED,
    CPCase,
    cp_step_errors,
)
from tests.support.hf_models import tiny_config
from tests.support.rank_harness import run_ranks

TOLERANCE = 1e-5

WORLD_4 = [
    CPCase("llama", pp=2, cp=2),
    CPCase("llama", pp=2, cp=2, padded=True),
    CPCase("mistral", pp=2, cp=2, length=16),  # sliding window 4 across chunk borders
    CPCase("phi3", pp=2, cp=2, length=16),  # fused qkv_proj, sliding window by config
    CPCase("gemma3_text", pp=2, cp=2, length=16, padded=True),  # sliding layer, scaled embedding
    CPCase("qwen3", pp=2, cp=2),  # per-head q_norm / k_norm
    CPCase("llama", pp=1, cp=4, length=16),
    # each replica its own rows; gradients averaged over dp × cp
    CPCase("llama", pp=1, cp=2, dp=2, padded=True),
    CPCase("llama", pp=1, cp=2, dp=2, zero=True),  # ZeRO-1 shards over dp × cp = 4
    CPCase("qwen2", pp=2, cp=2, zero=True, recompute="full"),
    CPCase("llama", pp=2, cp=2, padded=True, schedule="zb-h1", recompute="selective"),
    # cp over tp (tensor_parallel_hf, then context_parallel_hf): heads split, keys and
    # values of the local heads gathered over cp, the loss vocab-parallel
    CPCase("llama", pp=1, cp=2, tp=2, sequence_parallel=True, overlap=True),
    CPCase("qwen2", pp=1, cp=2, tp=2, sequence_parallel=True, padded=True),
    # ring attention: K/V passed round the cp group, online softmax
    CPCase("llama", pp=2, cp=2, ring=True),
    CPCase("mistral", pp=1, cp=4, length=16, padded=True, ring=True),
    CPCase("llama", pp=1, cp=2, tp=2, sequence_parallel=True, ring=True, recompute="full"),
]
PLANTED_CASES = [CPCase("llama", pp=2, cp=2, planted=name, ring=name.startswith("ring"))
                 for name in PLANTED]


def _run_cases(rank: int, world: int, cases: list[CPCase], planted: list[CPCase]) -> None:
    for case in cases:
        errors = cp_step_errors(case)
        assert max(errors.values()) < TOLERANCE, f"{case.label()}: {errors}"
    for case in planted:
        module, name, replacement = PLANTED[case.planted]
        original = getattr(module, name)
        setattr(module, name, replacement)
        try:
            errors = cp_step_errors(case)
        finally:
            setattr(module, name, original)
        assert max(errors.values()) > 1e-3, f"planted {case.planted} passed: {errors}"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pp2_cp2_and_cp4_equal_hf_and_planted_bugs_fail() -> None:
    run_ranks(_run_cases, 4, WORLD_4, PLANTED_CASES, timeout=900)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pp2_tp2_cp2_with_sequence_parallelism_equals_hf() -> None:
    run_ranks(_run_cases, 8, [CPCase("llama", pp=2, cp=2, tp=2, sequence_parallel=True)], [],
              timeout=600)


def test_a_sequence_that_does_not_cut_into_2cp_chunks_is_refused() -> None:
    with pytest.raises(PipelineConfigError, match=r"context_parallel=3 .* sequence length 8 "
                                                  r"is not a multiple of 6.*among \[1, 2, 4\]"):
        check_context_parallel_sequence(8, 3)
    check_context_parallel_sequence(8, 2)


@pytest.mark.parametrize("family", ["gpt2", "gemma2"])
def test_uncovered_families_are_refused_by_name(family: str) -> None:
    with pytest.raises(PipelineConfigError, match=f"covers model types .*got '{family}'"):
        context_parallel_hf(layers_from_hf(tiny_config(family, tied=False)))


def test_an_uncovered_moe_family_is_refused_by_name() -> None:
    """Mixtral, Qwen2-MoE and Qwen3-MoE are covered (tests/interop/
    test_hf_moe_context_parallel.py); OLMoE is named with the ones that are."""
    from tests.support.hf_moe_models import tiny_moe_config

    with pytest.raises(PipelineConfigError, match=r"families mixtral, qwen2_moe, qwen3_moe, "
                                                  r"not 'olmoe'"):
        context_parallel_hf(layers_from_hf(tiny_moe_config("olmoe")))
    assert context_parallel_hf(layers_from_hf(tiny_moe_config("mixtral"))).balance is not None


def test_bidirectional_attention_is_refused() -> None:
    config = tiny_config("gemma3_text", tied=False)
    config.use_bidirectional_attention = True
    with pytest.raises(PipelineConfigError, match="use_bidirectional_attention=True"):
        context_parallel_hf(layers_from_hf(config))


def test_an_unknown_attention_is_refused() -> None:
    with pytest.raises(PipelineConfigError, match="'all-gather' or 'ring', got 'flash'"):
        context_parallel_hf(layers_from_hf(tiny_config("llama", tied=False)),
                            attention="flash")  # type: ignore[arg-type]


def test_other_transforms_are_refused() -> None:
    hf = context_parallel_hf(layers_from_hf(tiny_config("llama", tied=False)))
    with pytest.raises(PipelineConfigError, match="apply it last"):
        context_parallel_hf(hf)


def test_tied_embeddings_are_refused() -> None:
    with pytest.raises(PipelineConfigError, match="tied input and output embeddings"):
        context_parallel_hf(layers_from_hf(tiny_config("llama", tied=True)))
