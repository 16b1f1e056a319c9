"""DeepSeek-V2 / V3's multi-head latent attention in the planner: parameters against HF models
transformers builds from tiny configs and against DeepSeek's published totals for the real
configs, FLOPs per token and kept activations against oracles written here from the
definitions, which GEMMs are split over tp and which replicated, the two-head-size attention
core, the model-string keys, the CLI path and the refusals."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from pipeline.cli import main
from pipeline.planner import (
    PRESETS,
    PlanError,
    SearchOptions,
    load_model,
    parse_shape,
    plan,
    transformer_profile,
)
from pipeline.planner.hf_config import shape_from_hf_config
from pipeline.planner.kernels import attention_core_seconds, block_linear_times, gemm_seconds
from pipeline.planner.latent_attention import LatentAttention
from pipeline.planner.transformer import TransformerShape

transformers = pytest.importorskip("transformers")

__all__: list[str] = []

H100 = PRESETS["h100-80g"]
TINY = {"num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 8,
        "intermediate_size": 96, "moe_intermediate_size": 32, "n_routed_experts": 8,
        "n_shared_experts": 2, "first_k_dense_replace": 1, "num_experts_per_tok": 2,
        "vocab_size": 100, "max_position_embeddings": 32, "kv_lora_rank": 16,
        "q_lora_rank": 24, "qk_nope_head_dim": 12, "qk_rope_head_dim": 4, "v_head_dim": 10}
TINY_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "v3-grouped": ("DeepseekV3Config", {"n_group": 4, "topk_group": 2}),
    "v2": ("DeepseekV2Config", {}),
    "v2-lite-direct-query": ("DeepseekV2Config", {"q_lora_rank": None}),
}
MLA = {"kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
       "qk_nope_head_dim": 128, "v_head_dim": 128, "max_position_embeddings": 163840}
V3 = MLA | {"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
            "intermediate_size": 18432, "moe_intermediate_size": 2048,
            "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
            "n_shared_experts": 1, "n_routed_experts": 256, "num_experts_per_tok": 8,
            "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4,
            "topk_method": "noaux_tc", "tie_word_embeddings": False, "head_dim": 64}
"""deepseek-ai/DeepSeek-V3's config.json (its keys the planner reads)."""
V2 = MLA | {"model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 5120,
            "intermediate_size": 12288, "moe_intermediate_size": 1536,
            "num_hidden_layers": 60, "num_attention_heads": 128, "num_key_value_heads": 128,
            "n_shared_experts": 2, "n_routed_experts": 160, "num_experts_per_tok": 6,
            "first_k_dense_replace": 1, "n_group": 8, "topk_group": 3,
            "topk_method": "group_limited_greedy"}
"""deepseek-ai/DeepSeek-V2's config.json."""
V2_LITE = V2 | {"hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
                "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
                "n_routed_experts": 64, "q_lora_rank": None, "topk_method": "greedy",
                "n_group": 1, "topk_group": 1}
"""deepseek-ai/DeepSeek-V2-Lite's config.json."""


def _tiny(name: str) -> tuple[Any, dict[str, Any]]:
    class_name, arguments = TINY_MODELS[name]
    config = getattr(transformers, class_name)(**(TINY | arguments))
    model = transformers.AutoModelForCausalLM.from_config(config)
    return model, json.loads(config.to_json_string(use_diff=True))


def _count(module: Any) -> int:
    return sum(parameter.numel() for parameter in module.parameters())


def _attention_flops(h: int, a: int, s: int, c: dict[str, Any]) -> int:
    """MLA's forward FLOPs per token from its definition (DeepSeek-V2, section 2.1): 2 per
    weight of q_a, q_b (or q_proj), kv_a, kv_b, o; Q·Kᵀ over d_n + d_r and P·V over d_v,
    2·s·a·d each."""
    r_q, r_kv = c["q_lora_rank"] or 0, c["kv_lora_rank"]
    d_n, d_r, d_v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    query = h * r_q + r_q * a * (d_n + d_r) if r_q else h * a * (d_n + d_r)
    weights = query + h * (r_kv + d_r) + r_kv * a * (d_n + d_v) + a * d_v * h
    return 2 * weights + 2 * s * a * (d_n + d_r) + 2 * s * a * d_v


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_parameters_and_flops_equal_the_hf_model(name: str, tmp_path: Path) -> None:
    model, document = _tiny(name)
    (tmp_path / "config.json").write_text(json.dumps(document))
    profile = load_model(str(tmp_path))  # the directory, as `plan --model` takes it
    assert profile.num_parameters == _count(model)
    shape = shape_from_hf_config(document)
    assert shape.num_parameters() == _count(model)
    h, a, s, c = 64, 8, 32, TINY | TINY_MODELS[name][1]
    expected = 2 * h * 100
    for block in model.model.layers:  # the MLP's FLOPs: 2 per weight a token runs through
        mlp = dict(block.mlp.named_children())
        if "experts" in mlp:
            routed = _count(mlp["experts"]) * 2 // 8
            weights = routed + _count(mlp["shared_experts"]) + mlp["gate"].weight.numel()
        else:
            weights = _count(block.mlp)
        expected += 2 * weights + _attention_flops(h, a, s, c)
    assert shape.flops_per_token() == expected
    assert profile.flops_per_sample == pytest.approx(s * expected, rel=1e-12)


def _active(shape: TransformerShape) -> int:
    """Parameters a token runs through as DeepSeek counts them: all but the routed experts it
    is not sent to and the input embedding table (a lookup: with it V3 would be 37.6B)."""
    assert shape.moe is not None
    sparse = sum(map(shape.is_sparse, range(shape.layers)))
    idle = sparse * (shape.moe.experts - shape.moe.topk) * 3 * shape.hidden \
        * shape.moe.expert_ffn
    return shape.num_parameters() - idle - shape.vocab * shape.hidden


@pytest.mark.parametrize(("config", "total", "active"), [
    (V3, 671e9, 37), (V2, 236e9, 21)])
def test_the_real_configs_have_deepseeks_published_totals(
        config: dict[str, Any], total: float, active: int) -> None:
    """DeepSeek-V3 (arXiv 2412.19437: 671B total, 37B activated per token) and DeepSeek-V2
    (arXiv 2405.04434: 236B, 21B); the active figure is stated to the billion, so the count
    must round to it."""
    shape = shape_from_hf_config(config, seq=4096)
    assert shape.num_parameters() == pytest.approx(total, rel=0.01)
    assert round(_active(shape) / 1e9) == active
    lite = shape_from_hf_config(V2_LITE, seq=4096)  # 15.7B total (the V2-Lite model card)
    assert round(lite.num_parameters() / 1e8) == 157


def test_real_v3_flops_per_token_follow_the_definition() -> None:
    shape = shape_from_hf_config(V3, seq=4096)
    h, f, fe, vocab = 7168, 18432, 2048, 129280
    dense = _attention_flops(h, 128, 4096, V3) + 2 * 3 * h * f
    sparse = _attention_flops(h, 128, 4096, V3) + 2 * 3 * h * (8 * fe + fe) + 2 * h * 256
    assert shape.flops_per_token() == 3 * dense + 58 * sparse + 2 * h * vocab


def test_gemms_split_by_heads_and_down_projections_replicated() -> None:
    """q_a / kv_a whole on every rank (the engine's `split_latent_attention`, Megatron-Core's
    duplicated TELinear), q_b / q_proj / kv_b column-parallel and o row-parallel, as
    transformers' own DeepSeek-V2 tp plan has them; shapes as HF's Linear modules."""
    plan = transformers.DeepseekV2Config().base_model_tp_plan
    kinds = {"colwise": "column", "rowwise": "row"}
    hf_names = {"q_a": "q_a_proj", "q_b": "q_b_proj", "q_proj": "q_proj",
                "kv_a": "kv_a_proj_with_mqa", "kv_b": "kv_b_proj", "o": "o_proj"}
    for name in ("v2", "v2-lite-direct-query"):
        model, document = _tiny(name)
        latent = shape_from_hf_config(document).latent
        assert latent is not None
        attention = model.model.layers[0].self_attn
        gemms = latent.gemms(64, 8)
        assert {gemm.name for gemm in gemms} == {
            key for key, module in hf_names.items() if getattr(attention, module, None)}
        for gemm in gemms:
            linear = getattr(attention, hf_names[gemm.name])
            assert (gemm.inputs, gemm.outputs) == (linear.in_features, linear.out_features)
            style = plan.get(f"layers.*.self_attn.{hf_names[gemm.name]}")
            assert gemm.kind == kinds.get(style or "", "replicated"), gemm
        for gemm, split in zip(gemms, latent.gemms(64, 8, 4)):
            whole = (gemm.inputs, gemm.outputs)
            assert (split.inputs, split.outputs) == {
                "replicated": whole, "column": (gemm.inputs, gemm.outputs // 4),
                "row": (gemm.inputs // 4, gemm.outputs)}[gemm.kind]


SHAPE = ("layers=2,hidden=1024,heads=16,vocab=1000,seq=2048,mlp=swiglu,norm=rmsnorm,"
         "bias=none,learned_positions=false,dropout=false,ffn=2816,kv_lora_rank=256,"
         "q_lora_rank=384,qk_nope_head_dim=64,qk_rope_head_dim=32,v_head_dim=48")


def test_kernel_model_runs_the_gemms_and_core_of_the_definition() -> None:
    shape = parse_shape(SHAPE)
    block = transformer_profile(shape).layers[1].shape
    assert block is not None and block.latent is not None
    b, s, h, e = 2, 2048, 1024, 2
    tokens = b * s

    def linear(m: int, k: int, n: int) -> tuple[float, float, float]:
        return tuple(gemm_seconds(*dims, H100, "bf16") for dims in  # type: ignore[return-value]
                     ((m, n, k), (m, k, n), (k, n, m)))

    for tp in (1, 2, 4):
        heads = 16 // tp
        column = [linear(tokens, h, 384), linear(tokens, 384, heads * 96),  # q_a, q_b
                  linear(tokens, h, 256 + 32), linear(tokens, 256, heads * (64 + 48))]
        (kind_in, qkv), (kind_out, proj) = block_linear_times(block, b, tp, H100, "bf16")[:2]
        assert (kind_in, kind_out) == ("column", "row")
        assert qkv == pytest.approx(tuple(map(sum, zip(*column))), rel=1e-12)
        assert proj == pytest.approx(linear(tokens, heads * 48, h), rel=1e-12)
        # fused core: Q·Kᵀ over d_qk = 96, P·V over d_v = 48, at 3/4 of a GEMM's rate
        core = sum(gemm_seconds(m, n, k, H100, "bf16", batch=b * heads, efficiency=0.75,
                                element=e) for m, n, k in ((s, s, 96), (s, 48, s)))
        assert attention_core_seconds(block, b, tp, H100, "bf16") == pytest.approx(
            core - H100.kernel_overhead, rel=1e-12)
    # at tp 8 the down-projections are still whole: the input side costs more than they do
    eight = block_linear_times(block, b, 8, H100, "bf16")[0][1][0]
    assert eight > linear(tokens, h, 384)[0] + linear(tokens, h, 288)[0]


@pytest.mark.parametrize("attention", ["fused", "eager"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_kept_activations_follow_the_definition(attention: str,
                                                sequence_parallel: bool) -> None:
    """Korthikanti et al. 2022's block (16-bit, no dropout) with MLA's tensors, per token:
    whole over tp without sequence parallelism, the input norm's and the down-projections'
    input, the MLP norm's and its first linear's input (2h bytes each), and, whole even with
    it (the engine runs the latents on every rank), each latent norm's input and the up-
    projection's (2·r bytes each, both latents); split by heads Q and K (2·a·d_qk each), V and
    the core's output (2·a·d_v each), the fused kernel's fp32 log-sum-exp (4a) or eager's
    scores (2 tensors of 2·a·s); the SwiGLU MLP's three f-wide tensors (6f)."""
    shape = parse_shape(SHAPE)
    s, h, a, f = 2048, 1024, 16, 2816
    latents = 2 * (2 * 384 + 2 * 256)
    norms = 8 * h
    split = 2 * (2 * a * 96 + 2 * a * 48) + 6 * f + (4 * a if attention == "fused"
                                                      else 4 * a * s)
    replicated, divided = shape.block_activation_bytes(
        2, attention=attention, sequence_parallel=sequence_parallel)  # type: ignore[arg-type]
    for t in (1, 2, 8):
        expected = s * (latents + (norms + split) / t if sequence_parallel
                        else latents + norms + split / t)
        assert replicated + divided / t == pytest.approx(expected, rel=1e-12)
    full = sum(shape.block_activation_bytes(2, recompute="full"))
    assert full == 2 * s * h  # full recomputation keeps the block's input only


def test_the_model_string_reads_the_same_attention_as_the_hf_config() -> None:
    shape = shape_from_hf_config(V3, seq=4096)
    assert shape.latent is not None and shape.moe is not None
    text = ("layers=61,hidden=7168,heads=128,vocab=129280,seq=4096,ffn=18432,mlp=swiglu,"
            "norm=rmsnorm,bias=none,learned_positions=false,dropout=false,"
            f"{shape.latent.model_string()},{shape.moe.model_string()}")
    assert parse_shape(text) == shape
    direct = shape_from_hf_config(V2_LITE, seq=4096).latent
    assert direct == LatentAttention(kv_lora_rank=512, qk_nope_head_dim=128,
                                     qk_rope_head_dim=64, v_head_dim=128)


def test_plan_prices_deepseek_configs(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                      ) -> None:
    for name, config in (("v3", V3), ("lite", V2_LITE)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    code = main(["plan", "--model", str(tmp_path / "v3"), "--cluster", "h100-80g", "--nodes",
                 "256", "--global-batch", "1920", "--seq", "4096", "--price",
                 "pp16,tp1,dp128,ep64,1f1b,b1"])
    out = capsys.readouterr().out
    assert code == 0 and "mla=q1536/kv512 d128+64/v128" in out
    code = main(["plan", "--model", str(tmp_path / "lite"), "--cluster", "h100-80g",
                 "--global-batch", "16", "--seq", "2048", "--sequence-parallel", "--price",
                 "pp1,tp2,dp4,ep4,1f1b,b1"])
    out = capsys.readouterr().out
    assert code == 0 and "mla=q-direct/kv512" in out


@pytest.mark.parametrize(("source", "words"), [
    (SHAPE.replace(",v_head_dim=48", ""), "but not v_head_dim"),
    (SHAPE.replace("q_lora_rank=384", "q_lora_rank=-1"), "q_lora_rank=-1 must be"),
    (SHAPE + ",kv_heads=4", "kv_heads=4 with multi-head latent attention"),
    (SHAPE + ",head_dim=64", "head_dim=64 with multi-head latent attention"),
    (SHAPE.replace("bias=none", "bias=qkv"), "bias='qkv' with multi-head latent"),
    (V3 | {"q_lora_rank": 0}, "q_lora_rank=0 builds an empty query latent"),
    (V3 | {"kv_lora_rank": None}, "kv_lora_rank=None must be a whole number"),
    (V3 | {"attention_bias": True}, "attention_bias"),
])
def test_shapes_outside_the_latent_model_are_refused_by_name(source: Any, words: str) -> None:
    with pytest.raises(PlanError, match=words):
        if isinstance(source, dict):
            shape_from_hf_config(source)
        else:
            parse_shape(source)


def test_context_parallelism_is_refused_for_latent_attention() -> None:
    """The engine's cp does not run MLA (`pipeline.interop.hf_moe_context`): a dense MLA
    shape, which no expert refusal catches, is refused by name, not priced as GQA's K/V."""
    with pytest.raises(PlanError, match="multi-head latent attention, which the engine's "
                                        "context parallelism does not run"):
        plan(load_model(SHAPE), H100, 8, options=SearchOptions(context_parallel=(2,)))


def test_megatron_lm_2021_has_no_latent_attention() -> None:
    with pytest.raises(PlanError, match="no multi-head latent attention"):
        transformer_profile(parse_shape(SHAPE), engine="megatron-2021")
    dense = replace(parse_shape(SHAPE), latent=None, head_dim=64)
    assert math.isclose(transformer_profile(dense, engine="megatron-2021").num_parameters,
                        dense.num_parameters())
