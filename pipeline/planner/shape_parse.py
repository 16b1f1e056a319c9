"""Read a transformer's shape: a `key=value,..` model string, a JSON file, or a mapping."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from pipeline.planner.errors import PlanError
from pipeline.planner.input_files import read_input_json
from pipeline.planner.latent_attention import LATENT_KEYS, LatentAttention
from pipeline.planner.moe_shape import MOE_KEYS, ExpertShape
from pipeline.planner.transformer import TransformerShape

__all__ = ["parse_shape"]

_BOOL_KEYS = {"learned_positions", "tied_embeddings", "qk_norm", "shared_gate", "dropout"}
_TEXT_KEYS = {"mlp", "norm", "bias"}
_LIST_KEYS = {"dense_layers"}
_INT_KEYS = ({f.name for f in fields(TransformerShape)} | set(MOE_KEYS) | set(LATENT_KEYS)) \
    - _BOOL_KEYS - _TEXT_KEYS - _LIST_KEYS - {"moe", "latent"}
_TRUE, _FALSE = ("1", "true", "yes"), ("0", "false", "no")


def parse_shape(source: str | Mapping[str, Any], *, seq: int | None = None) -> TransformerShape:
    """`layers=32,hidden=4096,heads=32,vocab=32000,seq=2048[,ffn=..,kv_heads=..,
    mlp=swiglu,tied_embeddings=true,..]` (every field of `TransformerShape`; a mixture of
    experts with `ExpertShape`'s: experts=8,topk=2,expert_ffn=14336[,shared_ffn=..,
    shared_gate=true,sparse_step=..,dense_layers=0;5]), multi-head latent attention with
    `LatentAttention`'s (HF's DeepSeek names): kv_lora_rank=512,qk_nope_head_dim=128,
    qk_rope_head_dim=64,v_head_dim=128[,q_lora_rank=1536; 0 or left out: a direct query
    projection], a JSON file with those keys, or a mapping; `seq` overrides the sequence
    length."""
    if isinstance(source, Mapping):
        values = dict(source)
    elif source.endswith(".json") or os.path.exists(source):

        values = read_input_json(source, "model file")
        if not isinstance(values, dict):
            raise PlanError(f"model file {source!r} must hold a JSON object")
    else:
        values = {}
        for item in filter(None, source.split(",")):
            key, sep, text = item.partition("=")
            if not sep:
                raise PlanError(f"model shape item {item!r} is not key=value; e.g. "
                                f"layers=24,hidden=2048,heads=16,vocab=50257,seq=2048")
            key = key.strip()
            if key in values:
                raise PlanError(f"model shape gives {key}= twice ({source[:120]!r}); give "
                                "each key once")
            if key in _BOOL_KEYS:
                word = text.strip().lower()
                if word not in _TRUE + _FALSE:
                    raise PlanError(f"model shape {key}={text!r} must be true or false")
                values[key] = word in _TRUE
                continue
            if key in _TEXT_KEYS:
                values[key] = text.strip().lower()
                continue
            if key in _LIST_KEYS:  # block indices; ";" apart, as "," separates the keys
                try:
                    values[key] = [int(part) for part in text.split(";") if part.strip()]
                except ValueError:
                    raise PlanError(f"model shape {key}={text!r} must be block indices "
                                    f"separated by ';', e.g. {key}=0;5") from None
                continue
            try:
                values[key] = int(text)
            except ValueError:
                raise PlanError(f"model shape {key}={text!r} must be a whole number") from None
    if seq is not None:
        values["seq"] = seq
    explicit_zero = [key for key in ("ffn", "kv_heads", "head_dim", "positions")
                     if values.get(key) == 0]
    if explicit_zero:  # 0 is the dataclass's "use the default", not a size anyone means
        raise PlanError(f"model shape {', '.join(f'{key}=0' for key in explicit_zero)}: "
                        "must be >= 1; omit the key for the default (ffn 4 × hidden, "
                        "kv_heads = heads, head_dim = hidden / heads)")
    known = _INT_KEYS | _BOOL_KEYS | _TEXT_KEYS | _LIST_KEYS
    unknown = sorted(set(values) - known)
    if unknown:
        raise PlanError(f"model shape has unknown keys {unknown}; the keys are {sorted(known)}")
    missing = sorted({"layers", "hidden", "heads", "vocab", "seq"} - set(values))
    if missing:
        raise PlanError(f"model shape lacks {missing} (give seq with --seq)")
    moe = _expert_shape(values)  # takes its keys out of `values`
    latent = _latent_attention(values)  # and these
    return TransformerShape(**values, moe=moe, latent=latent)


def _latent_attention(values: dict[str, Any]) -> LatentAttention | None:
    """The `LatentAttention` keys taken out of `values` (None when it has none)."""
    given = {key: values.pop(key) for key in LATENT_KEYS if key in values}
    if not given:
        return None
    missing = [key for key in LATENT_KEYS[1:] if key not in given]
    if missing:
        raise PlanError(f"model shape gives {', '.join(sorted(given))} but not "
                        f"{', '.join(missing)}: multi-head latent attention needs "
                        "kv_lora_rank=, qk_nope_head_dim=, qk_rope_head_dim= and v_head_dim= "
                        "(e.g. DeepSeek-V3's 512, 128, 64, 128; q_lora_rank= optional)")
    return LatentAttention(**given)


def _expert_shape(values: dict[str, Any]) -> ExpertShape | None:
    """The `ExpertShape` keys taken out of `values` (None when it has none)."""
    given = {key: values.pop(key) for key in MOE_KEYS if key in values}
    if not given:
        return None
    missing = [key for key in ("experts", "topk", "expert_ffn") if key not in given]
    if missing:
        raise PlanError(f"model shape gives {', '.join(sorted(given))} but not "
                        f"{', '.join(missing)}: a mixture of experts needs experts=, topk= and "
                        "expert_ffn= (e.g. experts=8,topk=2,expert_ffn=14336)")
    if isinstance(given.get("dense_layers"), list):
        given["dense_layers"] = tuple(given["dense_layers"])
    return ExpertShape(**given)
