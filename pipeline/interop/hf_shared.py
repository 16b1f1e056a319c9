"""What the dense and MoE HF builders share: HFLayers, the loss, embedding, masks."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.model.layers import Layer
from pipeline.moe.balance_loss import BalanceLoss
from pipeline.moe.balancing import MoEBalancing
from pipeline.runtime.loss_normalization import SummedLoss

__all__ = ["IGNORE_INDEX", "HFLayers", "causal_lm_loss", "causal_lm_targets",
           "generation_tokens"]

IGNORE_INDEX = -100
"""Label of a token that takes no part in the loss (HF's convention)."""
_SLIDING_BY_CONFIG = ("mistral", "phi3", "mixtral")
"""Families whose every layer slides when ``sliding_window`` is set (no ``layer_types``)."""


@dataclass(frozen=True)
class HFLayers:
    """A HF causal LM as a layer list, with what loading and exporting its weights needs."""

    layers: list[Layer]
    """Pass to `PipelineModule(layers, ...)`: embedding, blocks, final norm, lm_head."""
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    """HF's shifted causal-LM loss (mean over tokens whose label is not -100; MoE
    families: of (logits, balance), adding the carried load-balancing loss)."""
    names: tuple[tuple[str, str], ...]
    """Per layer: (prefix of its parameter names here, prefix of the same names in HF's
    state dict), e.g. ``("layer.", "model.layers.3.")``."""
    config: Any
    """The `transformers.PretrainedConfig` the layers were built from."""
    summed_loss: SummedLoss
    """The same loss summed over tokens with their count: with
    `pipeline.runtime.loss_normalization.normalized_train_batch` the loss of a padded batch
    is weighted by tokens over microbatches and replicas, as HF computes it on the batch."""
    balance: BalanceLoss | None = None
    """Mixture-of-experts families with ``output_router_logits``: HF's router
    load-balancing loss, added to the loss when the step runs through
    `pipeline.moe.balance_loss.train_batch_balanced` (None: the family adds none)."""
    balancing: MoEBalancing | None = None
    """Mixture-of-experts families: how the layers balance their experts, resolved
    (`pipeline.moe.balancing`); None for dense families."""

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


def _embed(embedding: nn.Module, x: Any) -> tuple[torch.Tensor, ...]:
    """input_ids, (input_ids, attention_mask) or the decoding input (input_ids,
    attention_mask, position_ids[, cache_rows]) -> (hidden, position_ids[, mask[, rows]])."""
    parts = (x,) if isinstance(x, torch.Tensor) else tuple(x)
    ids, mask, positions, rows = (*parts, None, None, None)[:4]
    hidden = embedding(ids)
    if positions is None:
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    return (hidden, positions, *(t for t in (mask, rows) if t is not None))


def _import_transformers() -> Any:
    try:
        return importlib.import_module("transformers")
    except ImportError as error:
        raise ImportError("layers_from_hf needs transformers: pip install 'pipesched[hf]' "
                          "(or pip install transformers safetensors)") from error


def _attend_everywhere(batch: Any, head: Any, q: Any, kv: Any) -> torch.Tensor:
    """Gemma 3's bidirectional full attention: every pair (padding still masked)."""
    return torch.tensor(True, dtype=torch.bool)


@dataclass(frozen=True)
class _WithinWindow:
    """Gemma 3's bidirectional sliding attention: pairs closer than the window either way."""

    window: int

    def __call__(self, batch: Any, head: Any, q: Any, kv: Any) -> Any:
        return abs(q - kv) < self.window


def _mask_function(config: Any, index: int) -> Callable[..., Any]:
    masks = importlib.import_module("transformers.masking_utils")
    layer_types = getattr(config, "layer_types", None)
    sliding = (layer_types[index] == "sliding_attention") if layer_types else (
        config.model_type in _SLIDING_BY_CONFIG
        and getattr(config, "sliding_window", None) is not None)
    mask = masks.create_sliding_window_causal_mask if sliding else masks.create_causal_mask
    if getattr(config, "use_bidirectional_attention", False):
        # Gemma3TextModel.forward: the causal masks OR'ed with "every pair" (full attention)
        # or "closer than the window on either side" (sliding); the layers' own is_causal
        # follows the flag already
        window = config.sliding_window
        extra = _WithinWindow(window) if sliding else _attend_everywhere
        return functools.partial(mask, or_mask_function=extra)
    return mask


def generation_tokens(config: Any, model: Any) -> tuple[tuple[int, ...], int | None]:
    """The EOS ids HF's ``generate`` stops on by default, and the pad id it fills finished
    rows with: the model's generation config; for a config, the ``generation_config.json``
    beside it (as ``from_pretrained`` reads it), else the config's own
    (``GenerationConfig.from_model_config``)."""
    generation = importlib.import_module("transformers.generation")
    found = getattr(model, "generation_config", None) if model is not None else None
    if found is None:
        source = Path(str(getattr(config, "_name_or_path", "") or ""))
        found = generation.GenerationConfig.from_pretrained(source) \
            if (source / "generation_config.json").is_file() else \
            generation.GenerationConfig.from_model_config(config)
    eos, pad = found.eos_token_id, found.pad_token_id
    return (() if eos is None else (eos,) if isinstance(eos, int) else tuple(eos),
            pad if isinstance(pad, int) and not isinstance(pad, bool) else None)
