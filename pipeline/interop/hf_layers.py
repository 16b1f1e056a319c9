"""Hugging Face causal LMs as pipeline layers: `layers_from_hf(model_or_config)`.

Covered families (the decoder shapes tested here): GPT-2 (``gpt2``: token + learned position
embeddings, LayerNorm blocks, lm_head always tied to ``wte``) and the Llama shape (``llama``,
``mistral``, ``qwen2``, ``qwen3``, ``phi3``, ``gemma2``, ``gemma3_text``: token embedding
(scaled by sqrt(hidden) for Gemma), rotary positions (one per layer type for Gemma 3), RMSNorm
blocks, sliding-window layers where the config says so, lm_head tied when
``tie_word_embeddings``, logits soft-capped when ``final_logit_softcapping`` is set).
Mixture-of-experts families (``mixtral``, ``qwen2_moe``, ``qwen3_moe``, ``olmoe``,
``deepseek_v2``, ``deepseek_v3``) come from `pipeline.interop.hf_moe`; other MoE families are
refused.
Needs ``transformers`` (``pip install pipesched[hf]``, tested from 5.9 to 5.24); the core never
imports it. The layer modules, and the legend of the value between stages:
`pipeline.interop.hf_modules`.
"""

from __future__ import annotations

import copy
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from pipeline.errors import PipelineConfigError
from pipeline.interop.hf_modules import (
    GPT2Positions,
    HFBlock,
    HFEmbedding,
    HFFinalNorm,
    SoftCappedHead,
    _tied_head,
)
from pipeline.interop.hf_moe_families import COVERED_MOE, moe_refusal
from pipeline.interop.hf_recompute import mark_attention_cores
from pipeline.interop.hf_shared import (
    IGNORE_INDEX,
    HFLayers,
    _embed,
    _import_transformers,
    _mask_function,
    causal_lm_loss,
    causal_lm_targets,
    generation_tokens,
)
from pipeline.model.layers import Layer, LayerSpec
from pipeline.model.tied import TiedLayerSpec
from pipeline.moe.balancing import BalancingMethod, MoEBalancing
from pipeline.runtime.loss_normalization import token_cross_entropy

__all__ = ["IGNORE_INDEX", "HFLayers", "causal_lm_loss", "causal_lm_targets", "layers_from_hf"]


@dataclass(frozen=True)
class _Family:
    """Where a Llama-shaped family's classes live and how it departs from Llama."""

    module: str
    """``transformers.models.<module>.modeling_<module>``."""
    prefix: str
    """Class-name prefix: ``<prefix>DecoderLayer``, ``<prefix>RMSNorm``, ..."""
    scaled_embedding: bool = False
    """Gemma: the token embedding is multiplied by sqrt(hidden_size)
    (``<prefix>TextScaledWordEmbedding``)."""
    rotary_per_layer_type: bool = False
    """Gemma 3: one rotary table per layer type (local and global base frequencies)."""


_LLAMA_SHAPED = {
    "llama": _Family("llama", "Llama"), "mistral": _Family("mistral", "Mistral"),
    "qwen2": _Family("qwen2", "Qwen2"), "qwen3": _Family("qwen3", "Qwen3"),
    "phi3": _Family("phi3", "Phi3"),
    "gemma2": _Family("gemma2", "Gemma2", scaled_embedding=True),
    "gemma3_text": _Family("gemma3", "Gemma3", scaled_embedding=True,
                           rotary_per_layer_type=True)}
"""model_type -> its family's classes."""
SUPPORTED = ("gpt2", *_LLAMA_SHAPED)
MOE = tuple(COVERED_MOE)
"""Mixture-of-experts model types, built by `pipeline.interop.hf_moe`."""


# -- building -------------------------------------------------------------------------------

def _existing(module: nn.Module) -> Callable[[], nn.Module]:
    return lambda: module


def _modeling(config: Any) -> Any:
    module = "gpt2" if config.model_type == "gpt2" else _LLAMA_SHAPED[config.model_type].module
    return importlib.import_module(f"transformers.models.{module}.modeling_{module}")


def _make_embedding(config: Any, model: Any) -> Callable[[], nn.Module]:
    """A factory of the token embedding (the model's own module when given)."""
    if config.model_type == "gpt2":
        return _existing(model.transformer.wte) if model is not None else functools.partial(
            nn.Embedding, config.vocab_size, config.n_embd)
    if model is not None:
        return _existing(model.model.embed_tokens)
    family = _LLAMA_SHAPED[config.model_type]
    if family.scaled_embedding:
        scaled = getattr(_modeling(config), f"{family.prefix}TextScaledWordEmbedding")
        return functools.partial(scaled, config.vocab_size, config.hidden_size,
                                 config.pad_token_id, embed_scale=config.hidden_size ** 0.5)
    return functools.partial(nn.Embedding, config.vocab_size, config.hidden_size,
                             config.pad_token_id)


def _layers_for(config: Any, model: Any) -> tuple[list[Layer], list[tuple[str, str]]]:
    """The layer list and its name prefixes; from `model`'s modules when given (no copy),
    else as specs each rank builds only for its own stages."""
    n, kind = config.num_hidden_layers, config.model_type
    eos, pad = generation_tokens(config, model)
    tied = bool(getattr(config, "tie_word_embeddings", kind == "gpt2"))
    softcap = getattr(config, "final_logit_softcapping", None)
    modeling = _modeling(config)
    root = "transformer." if kind == "gpt2" else "model."
    embed_name = root + ("wte." if kind == "gpt2" else "embed_tokens.")
    make_embed = _make_embedding(config, model)
    layers: list[Layer] = [TiedLayerSpec("embed_tokens", make_embed, forward_fn=_embed)
                           if tied else LayerSpec(HFEmbedding.around, make_embed)]
    names = [("module." if tied else "embedding.", embed_name)]
    if kind == "gpt2":
        layers.append(LayerSpec(_gpt2_positions, config, model))
        names.append(("wpe.", "transformer.wpe."))
    for index in range(n):
        layers.append(LayerSpec(_block, modeling, config, index, model, eos, pad))
        names.append(("layer.", f"{root}{'h' if kind == 'gpt2' else 'layers'}.{index}."))
    layers.append(LayerSpec(_final_norm, modeling, config, model))
    names.append(("norm.", f"{root}{'ln_f' if kind == 'gpt2' else 'norm'}."))
    if tied:
        head = _tied_head if softcap is None else functools.partial(_tied_head,
                                                                    softcap=softcap)
        layers.append(TiedLayerSpec("embed_tokens", make_embed, forward_fn=head))
        names.append(("module.", embed_name))
    else:
        layers.append(LayerSpec(_lm_head, config, model))
        names.append(("" if softcap is None else "head.", "lm_head."))
    return layers, names


def _gpt2_positions(config: Any, model: Any) -> nn.Module:
    wpe = model.transformer.wpe if model is not None else nn.Embedding(config.n_positions,
                                                                       config.n_embd)
    return GPT2Positions(wpe, config.embd_pdrop)


def _block(modeling: Any, config: Any, index: int, model: Any,
           generation_eos: tuple[int, ...] = (), generation_pad: int | None = None
           ) -> nn.Module:
    if config.model_type == "gpt2":
        layer = model.transformer.h[index] if model is not None else modeling.GPT2Block(
            config, layer_idx=index)
        return HFBlock(layer, config, _mask_function(config, index), None,
                       generation_eos=generation_eos, generation_pad=generation_pad)
    family = _LLAMA_SHAPED[config.model_type]
    layer = model.model.layers[index] if model is not None else getattr(
        modeling, f"{family.prefix}DecoderLayer")(config, index)
    rotary = model.model.rotary_emb if model is not None else getattr(
        modeling, f"{family.prefix}RotaryEmbedding")(config=config)
    layer_type = config.layer_types[index] if family.rotary_per_layer_type else None
    return HFBlock(layer, config, _mask_function(config, index), rotary, layer_type,
                   generation_eos=generation_eos, generation_pad=generation_pad)


def _final_norm(modeling: Any, config: Any, model: Any) -> nn.Module:
    if config.model_type == "gpt2":
        norm = model.transformer.ln_f if model is not None else nn.LayerNorm(
            config.n_embd, eps=config.layer_norm_epsilon)
    else:
        norm = model.model.norm if model is not None else getattr(
            modeling, f"{_LLAMA_SHAPED[config.model_type].prefix}RMSNorm")(
                config.hidden_size, eps=config.rms_norm_eps)
    return HFFinalNorm(norm)


def _lm_head(config: Any, model: Any) -> nn.Module:
    head: nn.Module = model.lm_head if model is not None else nn.Linear(
        config.hidden_size, config.vocab_size, bias=False)
    softcap = getattr(config, "final_logit_softcapping", None)
    return head if softcap is None else SoftCappedHead(head, softcap)


def _experts(config: Any) -> int:
    """How many experts a mixture-of-experts config routes between (0 for a dense model)."""
    counts = [getattr(config, name, None) for name in
              ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")]
    return max((c for c in counts if isinstance(c, int)), default=0)


def _check_supported(config: Any) -> None:
    experts = _experts(config)
    if experts > 1:
        raise PipelineConfigError(f"{moe_refusal(config.model_type, experts)}; covered "
                                  f"dense types: {', '.join(SUPPORTED)}")
    if config.model_type == "gemma3":
        raise PipelineConfigError(
            "layers_from_hf covers Gemma 3's text model, not the image-text 'gemma3': pass "
            "its config.text_config (model type 'gemma3_text', Gemma3ForCausalLM)")
    if getattr(config, "use_bidirectional_attention", False) and \
            config.model_type != "gemma3_text":
        raise PipelineConfigError(
            f"use_bidirectional_attention=True is covered for 'gemma3_text' only, got "
            f"{config.model_type!r}: its masks would be built causally")
    if config.model_type not in SUPPORTED:
        raise PipelineConfigError(
            f"layers_from_hf covers model types {', '.join(SUPPORTED)}; got "
            f"{config.model_type!r}: write its layer list by hand (embedding, blocks, norm, "
            "head) as in pipeline/interop/hf_layers.py")


def _default_attention(config: Any) -> str:
    """HF's own choice for a model built from `config`: sdpa unless the family refuses it
    (Gemma 2: sdpa cannot soft-cap attention logits), then eager."""
    if config.model_type == "gpt2":
        return "sdpa"
    prefix = _LLAMA_SHAPED[config.model_type].prefix
    pretrained = getattr(_modeling(config), f"{prefix}PreTrainedModel", None)
    return "sdpa" if getattr(pretrained, "_supports_sdpa", True) else "eager"


def layers_from_hf(model_or_config: Any, *, attn_implementation: str | None = None,
                   expert_parallel: int = 1, capacity_factor: float | None = None,
                   balancing: MoEBalancing | BalancingMethod | None = None) -> HFLayers:
    """A HF causal LM (a model, or a config to build from) as pipeline layers.

    From a config, every layer is a spec: a rank builds only the layers of its own stages
    (then load weights with `pipeline.interop.hf_weights.load_hf_weights`). From a model,
    the layers are the model's own modules (every rank already holds the whole model). The
    input embedding and lm_head are one `TiedLayerSpec` key when the config ties them.
    Inputs are ``input_ids`` or ``(input_ids, attention_mask)``; targets come from
    `causal_lm_targets`. Mixture-of-experts families come from their config only
    (`pipeline.interop.hf_moe.moe_layers_from_hf`); load a model's weights with
    ``load_hf_weights(module, hf, model.state_dict())``; `expert_parallel` (the engine's
    ep) is checked against their experts; `capacity_factor` drops tokens over each
    expert's capacity (`pipeline.moe.capacity`; None: dropless, as HF; dense: refused);
    `balancing` how they balance their experts (`pipeline.moe.balancing.MoEBalancing` or a
    method's name: "hf-batch", "microbatch", "sequence", "aux-free", "none"; None: as the
    config's ``output_router_logits`` says; dense: refused).
    """
    transformers = _import_transformers()
    model: Any = model_or_config if isinstance(model_or_config, nn.Module) else None
    config = model.config if model is not None else model_or_config
    if not isinstance(config, transformers.PretrainedConfig):
        raise TypeError(f"layers_from_hf needs a transformers model or config, got "
                        f"{type(model_or_config).__name__}")
    if config.model_type in MOE:
        if model is not None:
            raise PipelineConfigError(
                f"layers_from_hf builds {config.model_type!r} from its config only (its MoE "
                "layers replace HF's): pass model.config, then load_hf_weights(module, hf, "
                "model.state_dict())")
        moe = importlib.import_module("pipeline.interop.hf_moe")
        built: HFLayers = moe.moe_layers_from_hf(config,
                                                 attn_implementation=attn_implementation,
                                                 expert_parallel=expert_parallel,
                                                 capacity_factor=capacity_factor,
                                                 balancing=balancing)
        return built
    _check_supported(config)
    if balancing is not None:
        raise PipelineConfigError(f"balancing={balancing!r} applies to mixture-of-experts "
                                  f"models; {config.model_type!r} is dense: drop it")
    if capacity_factor is not None:
        raise PipelineConfigError(f"capacity_factor={capacity_factor} applies to mixture-of-"
                                  f"experts models; {config.model_type!r} is dense: drop it")
    if model is None:
        config = copy.deepcopy(config)
        config._attn_implementation = (attn_implementation or config._attn_implementation
                                       or _default_attention(config))
    mark_attention_cores()  # attention's core is the blocks' selective-recompute region
    layers, names = _layers_for(config, model)
    return HFLayers(layers, causal_lm_loss, tuple(names), config,
                    token_cross_entropy(ignore_index=IGNORE_INDEX, shift=True))
