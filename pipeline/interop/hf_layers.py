"""Hugging Face causal LMs as pipeline layers: `layers_from_hf(model_or_config)`.

Covered families (the decoder shapes tested here): GPT-2 (``gpt2``: token + learned position
embeddings, LayerNorm blocks, lm_head always tied to ``wte``) and the Llama shape (``llama``,
``mistral``, ``qwen2``: token embedding, rotary positions, RMSNorm blocks, lm_head tied when
``tie_word_embeddings``). Needs ``transformers`` (``pip install pipesched[hf]``); the core
never imports it.

Legend of the value between stages: ``(hidden, position_ids)`` or, when the inputs came as
``(input_ids, attention_mask)``, ``(hidden, position_ids, attention_mask)``. Every block
rebuilds its causal mask and (Llama) its rotary ``position_embeddings`` from those: they
are cheap to recompute and carry no gradient, so nothing floating but ``hidden`` is sent.
"""

from __future__ import annotations

import copy
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.errors import PipelineConfigError
from pipeline.interop.hf_recompute import mark_attention_cores
from pipeline.model.layers import Layer, LayerSpec
from pipeline.model.tied import TiedLayerSpec
from pipeline.runtime.loss_normalization import SummedLoss, token_cross_entropy

__all__ = ["IGNORE_INDEX", "HFLayers", "causal_lm_loss", "causal_lm_targets", "layers_from_hf"]

IGNORE_INDEX = -100
"""Label of a token that takes no part in the loss (HF's convention)."""

_LLAMA_SHAPED = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}
"""model_type -> class-name prefix in ``transformers.models.<type>.modeling_<type>``."""
SUPPORTED = ("gpt2", *_LLAMA_SHAPED)


@dataclass(frozen=True)
class HFLayers:
    """A HF causal LM as a layer list, with what loading and exporting its weights needs."""

    layers: list[Layer]
    """Pass to `PipelineModule(layers, ...)`: embedding, blocks, final norm, lm_head."""
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """HF's shifted causal-LM loss (mean over tokens whose label is not -100)."""
    names: tuple[tuple[str, str], ...]
    """Per layer: (prefix of its parameter names here, prefix of the same names in HF's
    state dict), e.g. ``("layer.", "model.layers.3.")``."""
    config: Any
    """The `transformers.PretrainedConfig` the layers were built from."""
    summed_loss: SummedLoss
    """The same loss summed over tokens with their count: with
    `pipeline.runtime.loss_normalization.normalized_train_batch` the loss of a padded batch
    is weighted by tokens over microbatches and replicas, as HF computes it on the batch."""

    def hf_name(self, layer: int, name: str) -> str:
        """The HF state-dict key of parameter `name` of global layer `layer`."""
        local, hf = self.names[layer]
        if not name.startswith(local):
            raise KeyError(f"layer {layer}: parameter {name!r} does not start with {local!r}")
        return hf + name[len(local):]


def causal_lm_targets(input_ids: torch.Tensor,
                      attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Labels for `causal_lm_loss`: the input ids, with padding (mask 0) set to -100."""
    if attention_mask is None:
        return input_ids.clone()
    return input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token t predicts label t+1; mean cross entropy over labels that are not -100, in fp32
    (what ``model(input_ids, labels=labels).loss`` computes)."""
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    return F.cross_entropy(logits.float().flatten(0, -2), shifted.flatten(),
                           ignore_index=IGNORE_INDEX)


# -- the layers -----------------------------------------------------------------------------

def _embed(embedding: nn.Module, x: Any) -> tuple[torch.Tensor, ...]:
    """input_ids or (input_ids, attention_mask) -> (hidden, position_ids[, mask])."""
    ids, mask = (x, None) if isinstance(x, torch.Tensor) else (x[0], x[1] if len(x) > 1
                                                               else None)
    hidden = embedding(ids)
    positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    return (hidden, positions) if mask is None else (hidden, positions, mask)


def _tied_head(embedding: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    weight: Any = embedding.weight
    return F.linear(hidden, weight)


class HFEmbedding(nn.Module):
    """The token embedding (untied): input_ids or (input_ids, mask) in, the tuple out."""

    def __init__(self, embedding: nn.Module) -> None:
        super().__init__()
        self.embedding = embedding

    @classmethod
    def around(cls, make: Callable[[], nn.Module]) -> HFEmbedding:
        return cls(make())

    def forward(self, x: Any) -> tuple[torch.Tensor, ...]:
        return _embed(self.embedding, x)


class GPT2Positions(nn.Module):
    """GPT-2's learned position embedding added to the token embedding, then dropout."""

    def __init__(self, wpe: nn.Embedding, dropout: float) -> None:
        super().__init__()
        self.wpe = wpe
        self.drop = nn.Dropout(dropout)

    def forward(self, value: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, positions, *rest = value
        return (self.drop(hidden + self.wpe(positions)), positions, *rest)


class HFBlock(nn.Module):
    """One HF decoder layer on the carried tuple; rebuilds the mask (and rotary) it needs."""

    def __init__(self, layer: nn.Module, config: Any, mask_function: Callable[..., Any],
                 rotary: nn.Module | None) -> None:
        super().__init__()
        self.layer = layer
        self.rotary = rotary
        self.config = config
        self.mask_function = mask_function

    def forward(self, value: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, positions, *rest = value
        mask = self.mask_function(config=self.config, inputs_embeds=hidden,
                                  attention_mask=rest[0] if rest else None,
                                  past_key_values=None, position_ids=positions)
        extra = {} if self.rotary is None else {
            "position_embeddings": self.rotary(hidden, positions)}
        out = self.layer(hidden, attention_mask=mask, position_ids=positions, **extra)
        return (out[0] if isinstance(out, tuple) else out, positions, *rest)


class HFFinalNorm(nn.Module):
    """The final norm: the carried tuple in, the normalised hidden states out."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, value: tuple[torch.Tensor, ...]) -> torch.Tensor:
        out: torch.Tensor = self.norm(value[0])
        return out


# -- building -------------------------------------------------------------------------------

def _import_transformers() -> Any:
    try:
        return importlib.import_module("transformers")
    except ImportError as error:
        raise ImportError("layers_from_hf needs transformers: pip install 'pipesched[hf]' "
                          "(or pip install transformers safetensors)") from error


def _mask_function(config: Any, index: int) -> Callable[..., Any]:
    masks = importlib.import_module("transformers.masking_utils")
    layer_types = getattr(config, "layer_types", None)
    sliding = (layer_types[index] == "sliding_attention") if layer_types else (
        config.model_type == "mistral" and getattr(config, "sliding_window", None) is not None)
    return masks.create_sliding_window_causal_mask if sliding else masks.create_causal_mask


def _existing(module: nn.Module) -> Callable[[], nn.Module]:
    return lambda: module


def _layers_for(config: Any, model: Any) -> tuple[list[Layer], list[tuple[str, str]]]:
    """The layer list and its name prefixes; from `model`'s modules when given (no copy),
    else as specs each rank builds only for its own stages."""
    n, kind = config.num_hidden_layers, config.model_type
    tied = bool(getattr(config, "tie_word_embeddings", kind == "gpt2"))
    if kind == "gpt2":
        modeling = importlib.import_module("transformers.models.gpt2.modeling_gpt2")
        root, embed_name = "transformer.", "transformer.wte."
        make_embed: Callable[[], nn.Module] = _existing(model.transformer.wte) if model \
            else functools.partial(nn.Embedding, config.vocab_size, config.n_embd)
    else:
        modeling = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
        root, embed_name = "model.", "model.embed_tokens."
        make_embed = _existing(model.model.embed_tokens) if model else functools.partial(
            nn.Embedding, config.vocab_size, config.hidden_size, config.pad_token_id)
    layers: list[Layer] = [TiedLayerSpec("embed_tokens", make_embed, forward_fn=_embed)
                           if tied else LayerSpec(HFEmbedding.around, make_embed)]
    names = [("module." if tied else "embedding.", embed_name)]
    if kind == "gpt2":
        layers.append(LayerSpec(_gpt2_positions, config, model))
        names.append(("wpe.", "transformer.wpe."))
    for index in range(n):
        layers.append(LayerSpec(_block, modeling, config, index, model))
        names.append(("layer.", f"{root}{'h' if kind == 'gpt2' else 'layers'}.{index}."))
    layers.append(LayerSpec(_final_norm, modeling, config, model))
    names.append(("norm.", f"{root}{'ln_f' if kind == 'gpt2' else 'norm'}."))
    if tied:
        layers.append(TiedLayerSpec("embed_tokens", make_embed, forward_fn=_tied_head))
        names.append(("module.", embed_name))
    else:
        layers.append(LayerSpec(_lm_head, config, model))
        names.append(("", "lm_head."))
    return layers, names


def _gpt2_positions(config: Any, model: Any) -> nn.Module:
    wpe = model.transformer.wpe if model is not None else nn.Embedding(config.n_positions,
                                                                       config.n_embd)
    return GPT2Positions(wpe, config.embd_pdrop)


def _block(modeling: Any, config: Any, index: int, model: Any) -> nn.Module:
    if config.model_type == "gpt2":
        layer = model.transformer.h[index] if model is not None else modeling.GPT2Block(
            config, layer_idx=index)
        return HFBlock(layer, config, _mask_function(config, index), None)
    prefix = _LLAMA_SHAPED[config.model_type]
    layer = model.model.layers[index] if model is not None else getattr(
        modeling, f"{prefix}DecoderLayer")(config, index)
    rotary = model.model.rotary_emb if model is not None else getattr(
        modeling, f"{prefix}RotaryEmbedding")(config=config)
    return HFBlock(layer, config, _mask_function(config, index), rotary)


def _final_norm(modeling: Any, config: Any, model: Any) -> nn.Module:
    if config.model_type == "gpt2":
        norm = model.transformer.ln_f if model is not None else nn.LayerNorm(
            config.n_embd, eps=config.layer_norm_epsilon)
    else:
        norm = model.model.norm if model is not None else getattr(
            modeling, f"{_LLAMA_SHAPED[config.model_type]}RMSNorm")(
                config.hidden_size, eps=config.rms_norm_eps)
    return HFFinalNorm(norm)


def _lm_head(config: Any, model: Any) -> nn.Module:
    if model is not None:
        head: nn.Module = model.lm_head
        return head
    return nn.Linear(config.hidden_size, config.vocab_size, bias=False)


def layers_from_hf(model_or_config: Any, *, attn_implementation: str | None = None
                   ) -> HFLayers:
    """A HF causal LM (a model, or a config to build from) as pipeline layers.

    From a config, every layer is a spec: a rank builds only the layers of its own stages
    (then load weights with `pipeline.interop.hf_weights.load_hf_weights`). From a model,
    the layers are the model's own modules (every rank already holds the whole model). The
    input embedding and lm_head are one `TiedLayerSpec` key when the config ties them.
    Inputs are ``input_ids`` or ``(input_ids, attention_mask)``; targets come from
    `causal_lm_targets`.
    """
    transformers = _import_transformers()
    model: Any = model_or_config if isinstance(model_or_config, nn.Module) else None
    config = model.config if model is not None else model_or_config
    if not isinstance(config, transformers.PretrainedConfig):
        raise TypeError(f"layers_from_hf needs a transformers model or config, got "
                        f"{type(model_or_config).__name__}")
    if config.model_type not in SUPPORTED:
        raise PipelineConfigError(
            f"layers_from_hf covers model types {', '.join(SUPPORTED)}; got "
            f"{config.model_type!r}: write its layer list by hand (embedding, blocks, norm, "
            "head) as in pipeline/interop/hf_layers.py")
    if model is None:
        config = copy.deepcopy(config)
        config._attn_implementation = (attn_implementation or config._attn_implementation
                                       or "sdpa")
    mark_attention_cores()  # attention's core is the blocks' selective-recompute region
    layers, names = _layers_for(config, model)
    return HFLayers(layers, causal_lm_loss, tuple(names), config,
                    token_cross_entropy(ignore_index=IGNORE_INDEX, shift=True))

