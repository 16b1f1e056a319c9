"""A Hugging Face `config.json` as a transformer shape: read with json (bounded, no
transformers needed), mapped per family to the fields of `TransformerShape`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pipeline.planner.errors import PlanError
from pipeline.planner.input_files import read_input_json
from pipeline.planner.latent_attention import LATENT_KEYS, LatentAttention
from pipeline.planner.moe_shape import ExpertShape
from pipeline.planner.transformer import TransformerShape

__all__ = ["FAMILIES", "expert_shape_from_hf", "hf_model_type", "is_hf_config",
           "latent_attention_from_hf", "read_hf_config", "shape_from_hf_config"]

# model_type: what its modeling file builds that the config does not say, each family's
# defaults (its `*Config.__init__`) for the keys a saved config.json may leave out.
# Checked against the HF models' parameter counts in tests/planner/test_hf_shapes.py.
_LLAMA = {"mlp": "swiglu", "norm": "rmsnorm", "bias": "none", "learned_positions": False,
          "tied_embeddings": False}
FAMILIES: dict[str, dict[str, Any]] = {
    "gpt2": {"mlp": "gelu", "norm": "layernorm", "bias": "all", "learned_positions": True,
             "tied_embeddings": True},
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA | {"bias": "qkv"},
    "qwen3": _LLAMA | {"qk_norm": True, "head_dim": 128},
    "phi3": _LLAMA,
    "gemma2": _LLAMA | {"mlp": "geglu", "block_norms": 4, "tied_embeddings": True,
                        "head_dim": 256},
    "gemma3_text": _LLAMA | {"mlp": "geglu", "block_norms": 4, "qk_norm": True,
                             "tied_embeddings": True, "head_dim": 256},
    "mixtral": _LLAMA,
    "qwen2_moe": _LLAMA | {"bias": "qkv"},
    "qwen3_moe": _LLAMA | {"qk_norm": True, "head_dim": 128},
    "deepseek_v2": _LLAMA,
    "deepseek_v3": _LLAMA,
}
"""The families `pipeline.interop.hf_layers.layers_from_hf` runs (DeepSeek-V2 / V3 with
their multi-head latent attention, `latent_attention_from_hf`)."""

_MOE: dict[str, dict[str, Any]] = {
    # model_type: (config key or keys -> ExpertShape field, with the config class's default)
    "mixtral": {"experts": (("num_local_experts", "num_experts"), 8),
                "topk": (("num_experts_per_tok",), 2),
                "expert_ffn": (("intermediate_size",), 14336)},
    "qwen2_moe": {"experts": (("num_experts", "num_local_experts"), 60),
                  "topk": (("num_experts_per_tok",), 4),
                  "expert_ffn": (("moe_intermediate_size",), 1408),
                  "shared_ffn": (("shared_expert_intermediate_size",), 5632),
                  "sparse_step": (("decoder_sparse_step",), 1),
                  "dense_layers": (("mlp_only_layers",), ())},
    "qwen3_moe": {"experts": (("num_experts", "num_local_experts"), 128),
                  "topk": (("num_experts_per_tok",), 8),
                  "expert_ffn": (("moe_intermediate_size",), 768),
                  "sparse_step": (("decoder_sparse_step",), 1),
                  "dense_layers": (("mlp_only_layers",), ())},
    "deepseek_v3": {"experts": (("n_routed_experts",), 256),
                    "topk": (("num_experts_per_tok",), 8),
                    "expert_ffn": (("moe_intermediate_size",), 2048),
                    "expert_groups": (("n_group",), 8), "topk_groups": (("topk_group",), 4)},
    "deepseek_v2": {"experts": (("n_routed_experts",), 64),
                    "topk": (("num_experts_per_tok",), None),
                    "expert_ffn": (("moe_intermediate_size",), 1407)},
}
"""The mixture-of-experts families `pipeline.interop.hf_moe` runs: where their config holds
each `ExpertShape` field, and its default (the `*Config.__init__` of transformers 5).
Qwen2-MoE's shared expert is gated (`shared_expert_gate`); Qwen's dense blocks (mlp_only_layers,
or off the decoder_sparse_step) have an MLP of intermediate_size; Mixtral's experts are
intermediate_size wide and every block has them. DeepSeek-V2 / V3: n_shared_experts ungated
shared experts of moe_intermediate_size, the first
first_k_dense_replace blocks dense (HF's `DeepseekV3DecoderLayer`), group-limited routing
(`node_limited`): V3's always (n_group, topk_group), V2's under
topk_method="group_limited_greedy"."""
_LATENT_ATTENTION = ("deepseek_v2", "deepseek_v3")
_LATENT_DEFAULTS = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                    "qk_rope_head_dim": 64, "v_head_dim": 128}
"""`DeepseekV2Config`'s and `DeepseekV3Config`'s defaults (transformers 5) for MLA's keys."""
_DENSE_FFN = {"mixtral": None, "qwen2_moe": 5632, "qwen3_moe": 6144, "deepseek_v2": 11008,
              "deepseek_v3": 18432}
"""intermediate_size defaults of the MoE families' dense blocks (Mixtral has none)."""

_GPT2_KEYS = {"n_layer": "num_hidden_layers", "n_embd": "hidden_size",
              "n_head": "num_attention_heads", "n_inner": "intermediate_size",
              "n_positions": "max_position_embeddings"}


def is_hf_config(document: Any) -> bool:
    """Whether a JSON document is a HF model config (it names its `model_type`)."""
    return isinstance(document, Mapping) and "model_type" in document


def read_hf_config(path: str) -> dict[str, Any]:
    """The config of a HF model directory (its config.json) or of a config.json file."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if os.path.isdir(path) and not os.path.exists(file):
        raise PlanError(f"model directory {path!r} holds no config.json; pass a HF model "
                        "directory or its config.json")
    document = read_input_json(file, "model config")
    if not is_hf_config(document):
        raise PlanError(f"{file!r} is not a HF config (no model_type); give a config.json "
                        "saved by transformers")
    return dict(document)


def _whole(config: Mapping[str, Any], key: str, where: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{where}: {key}={value!r} must be a whole number >= 1")
    return value


def _optional_whole(config: Mapping[str, Any], key: str, where: str) -> int | None:
    """`key`'s whole number >= 1, or None where the config leaves it out (null or absent):
    a 0 is refused, not read as "use the default" (an intermediate_size of 0 was priced as
    the family's default width, num_key_value_heads 0 as full multi-head attention)."""
    return None if config.get(key) is None else _whole(config, key, where)


def shape_from_hf_config(config: Mapping[str, Any], *, seq: int | None = None,
                         where: str = "HF config") -> TransformerShape:
    """The shape of the model a HF `config` builds; `seq` (default: its
    max_position_embeddings) the training sequence length."""
    family = config.get("model_type")
    if family not in FAMILIES:
        raise PlanError(f"{where}: model_type {family!r} is not one the planner reads; it "
                        f"reads {', '.join(FAMILIES)} (or give the shape as "
                        "layers=,hidden=,heads=,vocab=,seq=,...)")
    values = dict(config)
    if family == "gpt2":
        values |= {new: values[old] for old, new in _GPT2_KEYS.items() if old in values}
    experts = [key for key in ("num_local_experts", "num_experts", "n_routed_experts")
               if values.get(key)]
    if experts and family not in _MOE:
        raise PlanError(f"{where}: a mixture of experts ({experts[0]}={values[experts[0]]}) "
                        f"in a {family} config is not a shape the planner reads (its MoE "
                        f"families: {', '.join(_MOE)})")
    defaults = FAMILIES[family]
    if family == "qwen2_moe":  # transformers 5 names its attention bias qkv_bias
        defaults = defaults | {"bias": "qkv" if values.get("qkv_bias", True) else "none"}
    biased = [key for key in ("attention_bias", "mlp_bias") if values.get(key)]
    if biased:
        raise PlanError(f"{where}: {', '.join(biased)} on a {family} model is not a shape the "
                        "planner counts (its biases: all, qkv only, or none)")
    hidden = _whole(values, "hidden_size", where)
    heads = _whole(values, "num_attention_heads", where)
    positions = _whole(values, "max_position_embeddings", where)
    # MLA (`latent_attention_from_hf`) sizes its heads itself: DeepSeek's head_dim is the
    # rotary size and num_key_value_heads is not read by its attention (left out)
    latent = latent_attention_from_hf(values, where=where)
    head_dim = 0 if latent else (_optional_whole(values, "head_dim", where)
                                 or defaults.get("head_dim") or 0)
    tied = values.get("tie_word_embeddings", defaults["tied_embeddings"])
    fields = {key: value for key, value in defaults.items() if key != "head_dim"}
    moe = expert_shape_from_hf(values, where=where)
    ffn = (_optional_whole(values, "intermediate_size", where) or _DENSE_FFN.get(family)
           or 4 * hidden)
    kv_heads = heads if latent else _optional_whole(values, "num_key_value_heads", where) \
        or heads
    return TransformerShape(
        **(fields | {"tied_embeddings": bool(tied)}),
        layers=_whole(values, "num_hidden_layers", where), hidden=hidden, heads=heads,
        vocab=_whole(values, "vocab_size", where), seq=seq or positions,
        ffn=moe.expert_ffn if family == "mixtral" and moe is not None else ffn,
        kv_heads=kv_heads, head_dim=head_dim,
        positions=positions if defaults["learned_positions"] else 0, moe=moe, latent=latent,
        dropout=any(float(values.get(key) or 0.0) > 0 for key in _DROPOUT_KEYS))


def latent_attention_from_hf(config: Mapping[str, Any], *,
                             where: str = "HF config") -> LatentAttention | None:
    """The multi-head latent attention of a DeepSeek-V2 / V3 config (its `LATENT_KEYS`, the
    class defaults where left out); None for another family. q_lora_rank null is V2-Lite's
    direct query projection; a 0 is refused (HF would build an empty query latent)."""
    if config.get("model_type") not in _LATENT_ATTENTION:
        return None
    fields = {key: config.get(key, default) for key, default in _LATENT_DEFAULTS.items()}
    if fields["q_lora_rank"] is None:
        fields["q_lora_rank"] = 0
    elif fields["q_lora_rank"] == 0:
        raise PlanError(f"{where}: q_lora_rank=0 builds an empty query latent in HF's "
                        "attention; give null for a direct query projection (V2-Lite)")
    for key in LATENT_KEYS[1:]:
        _whole(fields, key, where)
    try:
        return LatentAttention(**fields)
    except PlanError as error:
        raise PlanError(f"{where}: {error}") from None


def expert_shape_from_hf(config: Mapping[str, Any], *,
                         where: str = "HF config") -> ExpertShape | None:
    """The experts of a MoE family's config (`_MOE`, by its model_type); None for a dense
    family."""
    family = config.get("model_type")
    if family not in _MOE:
        return None
    fields: dict[str, Any] = {}
    for name, (keys, default) in _MOE[family].items():
        found = next((config[key] for key in keys if config.get(key) is not None), default)
        fields[name] = tuple(found) if name == "dense_layers" else found
    if family == "qwen2_moe":
        fields["shared_gate"] = True
    if family in _LATENT_ATTENTION:
        shared = config.get("n_shared_experts") or 0
        dense = config.get("first_k_dense_replace") or 0
        fields["shared_ffn"] = shared * fields["expert_ffn"] if isinstance(shared, int) \
            and isinstance(fields["expert_ffn"], int) else shared
        fields["dense_layers"] = tuple(range(dense)) if isinstance(dense, int) else dense
    if family == "deepseek_v2" and config.get("topk_method") == "group_limited_greedy":
        fields |= {"expert_groups": config.get("n_group"),
                   "topk_groups": config.get("topk_group")}
    try:
        return ExpertShape(**fields)
    except (PlanError, TypeError) as error:
        raise PlanError(f"{where}: {error}") from None


_DROPOUT_KEYS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop",
                 "attn_pdrop")
"""The families' dropout rates: any above 0 keeps masks for the backward (GPT-2's 0.1);
Llama, Mistral, Qwen and Gemma train without (0.0), so no masks are counted."""


def hf_model_type(path: str) -> str | None:
    """The model_type of `path` if it is a HF model directory or config.json, else None."""
    if os.path.isdir(path):
        return str(read_hf_config(path)["model_type"])
    if not os.path.isfile(path):
        return None
    document = read_input_json(path, "model file")
    return str(document["model_type"]) if is_hf_config(document) else None
