"""Model shapes of current families (SwiGLU, grouped-query attention, untied embeddings, own
head size, q/k norms) from a HF config.json: the planner's parameter counts, FLOPs and
tensor-parallel splits against a HF model built from the same config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipeline.cli import main
from pipeline.planner import PlanError, load_model, parse_shape, transformer_profile
from pipeline.planner.hf_config import shape_from_hf_config

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

__all__: list[str] = []

TINY = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 8,
        "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 100,
        "max_position_embeddings": 32}
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (config class, its arguments); GQA (2 of 8 heads) everywhere but GPT-2
    "gpt2": ("GPT2Config", {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 100,
                            "n_positions": 32}),
    "llama-swiglu-gqa-untied": ("LlamaConfig", TINY),
    "llama-tied": ("LlamaConfig", TINY | {"tie_word_embeddings": True}),
    "mistral": ("MistralConfig", TINY),
    "qwen2-qkv-bias": ("Qwen2Config", TINY),
    "qwen3-qk-norm": ("Qwen3Config", TINY | {"head_dim": 16}),
    "phi3": ("Phi3Config", TINY | {"pad_token_id": 0}),
    "gemma2": ("Gemma2Config", TINY | {"head_dim": 16}),
    "gemma3": ("Gemma3TextConfig", TINY | {"head_dim": 16}),
}


def _hf(name: str) -> tuple[Any, dict[str, Any]]:
    """A HF model built from family `name`'s tiny config, and that config as config.json
    holds it (only what differs from the class's defaults: the planner must know those)."""
    class_name, arguments = FAMILIES[name]
    config = getattr(transformers, class_name)(**arguments)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return model, json.loads(config.to_json_string(use_diff=True))


def _count(module: Any) -> int:
    return sum(parameter.numel() for parameter in module.parameters())


def _blocks(model: Any) -> Any:
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def _matmul_weights(block: Any) -> int:
    """Weights of a block's matrix products (torch Linear, GPT-2's Conv1D): 2 FLOPs each
    per token."""
    return sum(module.weight.numel() for module in block.modules()
               if type(module).__name__ in ("Linear", "Conv1D"))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_parameters_and_flops_equal_the_hf_models(name: str, tmp_path: Path) -> None:
    model, document = _hf(name)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(document))
    for source in (str(path), str(tmp_path)):  # the file, or the model's directory
        profile = load_model(source)
        assert profile.num_parameters == _count(model), source
    shape = shape_from_hf_config(document)
    assert shape.num_parameters() == _count(model)
    block = _blocks(model)[0]
    assert shape.block_parameters() == _count(block)
    # the standard forward FLOPs per token (Kaplan et al. 2020, Narayanan et al. 2021):
    # 2 per weight of every matrix product, QKᵀ and its product with V 2·s·(a·d) each,
    # the logits 2·h·V
    s, q = shape.seq, shape.heads * shape.head_dim
    expected = shape.layers * (2 * _matmul_weights(block) + 4 * s * q) \
        + 2 * shape.hidden * shape.vocab
    assert shape.flops_per_token() == expected
    assert profile.flops_per_sample == pytest.approx(s * expected, rel=1e-12)


def test_swiglu_has_three_matrices_and_gqa_shrinks_keys_and_values() -> None:
    model, document = _hf("llama-swiglu-gqa-untied")
    shape = shape_from_hf_config(document)
    assert (shape.mlp, shape.kv_heads, shape.tied_embeddings) == ("swiglu", 2, False)
    mlp = _blocks(model)[0].mlp
    assert _count(mlp) == 3 * 64 * 96 == shape.block_parameters() - _count(
        _blocks(model)[0].self_attn) - 2 * 64
    attention = _blocks(model)[0].self_attn
    assert attention.k_proj.weight.shape == (2 * 8, 64)  # k = kv_heads · d = 16
    # untied: the head's own V × h, tied: the embedding's, held again on the head's rank
    untied = load_model(",".join(f"{key}={value}" for key, value in {
        "layers": 2, "hidden": 64, "heads": 8, "kv_heads": 2, "ffn": 96, "vocab": 100,
        "seq": 32, "mlp": "swiglu", "norm": "rmsnorm", "bias": "none",
        "learned_positions": "false"}.items()))
    assert untied.num_parameters == _count(model)
    assert untied.layers[-1].params_split == 100 * 64 and not untied.layers[-1].tied_params_split
    tied_model, tied_document = _hf("llama-tied")
    tied = transformer_profile(shape_from_hf_config(tied_document))
    assert tied.num_parameters == _count(tied_model) == _count(model) - 100 * 64
    assert tied.layers[-1].params_split == 0 and tied.layers[-1].tied_params_split == 100 * 64


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_split_is_megatrons(tp: int) -> None:
    # Megatron's split, from the HF modules: q/k/v, gate/up by columns (their biases too),
    # o and down by rows (their biases whole on each rank, added after the all-reduce),
    # norms whole
    model, document = _hf("qwen2-qkv-bias")
    block = _blocks(model)[0]
    split = sum(parameter.numel() for name, parameter in block.named_parameters()
                if "proj" in name and not (name.startswith(("self_attn.o_proj", "mlp.down_proj"))
                                           and name.endswith("bias")))
    whole = _count(block) - split
    profile = transformer_profile(shape_from_hf_config(document))
    layer = profile.layers[1]
    assert layer.params(tp) == split / tp + whole
    assert profile.layers[0].params(tp) == 100 * 64 / tp  # a vocab-parallel embedding


def test_tp_must_divide_heads_kv_heads_and_mlp_width(capsys: pytest.CaptureFixture[str]) -> None:
    profile = load_model("layers=4,hidden=1024,heads=16,kv_heads=4,ffn=2816,vocab=32000,"
                         "seq=512,mlp=swiglu")
    assert profile.tp_refusals(8) == ["4 key/value heads"]
    assert profile.tp_refusals(4) == []
    odd = load_model("layers=4,hidden=1024,heads=16,ffn=1000,vocab=32000,seq=512")
    assert odd.tp_refusals(16) == ["1000 MLP columns"]
    code = main(["plan", "--model", "layers=4,hidden=1024,heads=16,kv_heads=4,ffn=2816,"
                 "vocab=32000,seq=512,mlp=swiglu", "--cluster", "h100-80g", "--global-batch",
                 "8", "--tp", "8"])
    assert code == 2
    error = capsys.readouterr().err
    assert "tensor-parallel size 8 does not divide the model's 4 key/value heads" in error
    assert "use one of 1, 2, 4" in error


@pytest.mark.parametrize(("document", "words"), [
    ({"model_type": "bert"}, "model_type 'bert' is not one the planner reads"),
    # DeepSeek's multi-head latent attention is priced (test_latent_attention.py); a 0 query
    # rank is not "none" (null is): HF would build an empty latent
    (TINY | {"model_type": "deepseek_v3", "n_routed_experts": 8, "q_lora_rank": 0},
     "q_lora_rank=0"),
    (TINY | {"model_type": "qwen2", "num_experts": 8}, "mixture of experts"),
    (TINY | {"model_type": "llama", "attention_bias": True}, "attention_bias"),
    ({"model_type": "llama", "hidden_size": 64}, "num_attention_heads=None"),
    # a 0 is not "the default": it was priced as 256 wide / full multi-head, silently
    (TINY | {"model_type": "llama", "intermediate_size": 0}, "intermediate_size=0"),
    (TINY | {"model_type": "llama", "num_key_value_heads": 0}, "num_key_value_heads=0"),
    (TINY | {"model_type": "qwen3", "head_dim": 0}, "head_dim=0"),
    (TINY | {"model_type": "llama", "num_key_value_heads": "2"}, "num_key_value_heads='2'"),
])
def test_configs_outside_the_planners_shapes_are_refused_by_name(
        document: dict[str, Any], words: str) -> None:
    with pytest.raises(PlanError, match=words):
        shape_from_hf_config(document)


def test_a_directory_without_config_json_is_named(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match=r"holds no config\.json"):
        load_model(str(tmp_path))


def test_shape_keys_parse_and_refuse_bad_values() -> None:
    shape = parse_shape("layers=2,hidden=64,heads=8,vocab=100,seq=32,mlp=swiglu,kv_heads=2,"
                        "norm=rmsnorm,bias=none,head_dim=16,qk_norm=true,tied_embeddings=yes")
    assert (shape.q_width, shape.kv_width, shape.gated, shape.qk_norm) == (128, 32, True, True)
    with pytest.raises(PlanError, match="mlp='relu' must be one of gelu, swiglu, geglu"):
        parse_shape("layers=2,hidden=64,heads=8,vocab=100,seq=32,mlp=relu")
    with pytest.raises(PlanError, match="qk_norm='maybe' must be true or false"):
        parse_shape("layers=2,hidden=64,heads=8,vocab=100,seq=32,qk_norm=maybe")


def test_dropout_read_from_the_config() -> None:
    llama = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
             "max_position_embeddings": 32, "num_hidden_layers": 2, "vocab_size": 128,
             "intermediate_size": 128, "attention_dropout": 0.0}
    assert shape_from_hf_config(llama).dropout is False  # no masks held
    assert shape_from_hf_config(llama | {"attention_dropout": 0.1}).dropout is True


def test_a_null_or_absent_width_takes_the_default() -> None:
    base = TINY | {"model_type": "llama"}
    assert shape_from_hf_config(base | {"num_key_value_heads": None}).kv_heads == 8
    assert shape_from_hf_config({k: v for k, v in base.items()
                                 if k != "num_key_value_heads"}).kv_heads == 8
    assert shape_from_hf_config(base).kv_heads == 2
