"""Greedy decoding with a pipelined causal LM: a KV cache per stage, EOS stopping, left padding.

Legend: b prompts (rows), q tokens forwarded in a step, kv tokens seen so far.

With a cache (layers that implement `CachedDecoding`, e.g. `layers_from_hf`'s), step 0
(prefill) forwards the whole prompt and every later step only the last token, q = 1: each
stage keeps its own layers' keys and values on its rank, so only the new token's hidden
state travels between ranks and each step costs one token per stage instead of kv. The
first stage then receives the *decoding input*, one tensor per field, each with b rows:

    (input_ids (b, q), attention_mask (b, kv), position_ids (b, q), cache_rows (b,))

``cache_rows`` are the rows' indices in the whole batch (a layer keeps one cache per
microbatch, keyed by its first row). Without ``cache_rows`` the same input re-runs the
whole sequence (``use_cache=False``). Positions count real tokens only, as HF's
``generate`` does for a left-padded batch: ``attention_mask.cumsum(-1) - 1``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from pipeline.errors import PipelineConfigError

if TYPE_CHECKING:
    from pipeline.runtime.inference import Inference

__all__ = ["SPLITS_VOCABULARY", "WHOLE_SEQUENCE", "CachedDecoding", "greedy_generate"]


@runtime_checkable
class CachedDecoding(Protocol):
    """A layer that keeps per-row state (its keys and values) across decoding steps when it
    receives the decoding input; `greedy_generate` drops that state before and after."""

    def reset_decoding_cache(self) -> None: ...


def _cached_layers(inference: Inference) -> list[CachedDecoding]:
    return [m for m in inference.engine.module.modules() if isinstance(m, CachedDecoding)]


def _pipeline_supports_cache(inference: Inference, local: bool) -> bool:
    """Whether any stage of this rank's pipeline keeps a decoding cache (every rank of the
    pipeline gets the same answer: a rank may hold only the embedding)."""
    engine = inference.engine
    if not (dist.is_available() and dist.is_initialized()):
        return local
    flag = torch.tensor([int(local)])
    group = engine.groups.pp_group if engine.groups is not None else None
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def _checked(input_ids: Any, max_new_tokens: Any, attention_mask: Any, eos_token_id: Any,
             pad_token_id: Any) -> tuple[torch.Tensor, list[int]]:
    """The mask (ones when None) and the EOS ids, after checking every argument."""
    problems = []
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or \
            max_new_tokens < 0:
        problems.append(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or \
            input_ids.dtype.is_floating_point:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else None
        problems.append(f"input_ids must be an integer tensor (batch, seq), got "
                        f"{type(input_ids).__name__} of shape {shape}")
    elif attention_mask is not None and (
            not isinstance(attention_mask, torch.Tensor) or
            attention_mask.shape != input_ids.shape or
            not bool(((attention_mask == 0) | (attention_mask == 1)).all())):
        problems.append("attention_mask must be a 0/1 tensor of input_ids' shape "
                        f"{tuple(input_ids.shape)} (0 marks left padding)")
    eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
    if any(isinstance(e, bool) or not isinstance(e, int) for e in eos):
        problems.append(f"eos_token_id must be an int or a list of ints, got {eos_token_id!r}")
    if pad_token_id is not None and (isinstance(pad_token_id, bool) or
                                     not isinstance(pad_token_id, int)):
        problems.append(f"pad_token_id must be an int or None, got {pad_token_id!r}")
    if problems:
        raise PipelineConfigError("greedy_generate: " + "; ".join(problems))
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    return mask.to(input_ids.dtype), eos


def _generation_defaults(inference: Inference) -> tuple[list[int], int | None]:
    """The EOS ids HF's ``generate`` would stop on and the pad id it would fill finished
    rows with, given neither: those a layer of the model declares (``generation_eos_token_id``
    and ``generation_pad_token_id``, e.g. `layers_from_hf`'s blocks, from the checkpoint's
    generation config), agreed over the pipeline (a rank may hold no such layer)."""
    mine: tuple[list[int], int | None] | None = next(
        ((list(eos), getattr(m, "generation_pad_token_id", None))
         for m in inference.engine.module.modules()
         if (eos := getattr(m, "generation_eos_token_id", None)) is not None), None)
    if not (dist.is_available() and dist.is_initialized()):
        return mine or ([], None)
    engine = inference.engine
    group = engine.groups.pp_group if engine.groups is not None else None
    found: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, mine, group=group)
    declared = [tokens for tokens in found if tokens is not None]
    if any(tokens != declared[0] for tokens in declared):
        raise PipelineConfigError(f"the pipeline's layers declare different (EOS ids, pad id) "
                                  f"{declared}; pass greedy_generate(eos_token_id=..., "
                                  "pad_token_id=...)")
    return declared[0] if declared else ([], None)


def _last_token_choice(logits: torch.Tensor) -> torch.Tensor:
    """The greedy next token of every row from the last stage's logits (b, q, vocab)."""
    return logits[:, -1, :].argmax(dim=-1)


SPLITS_VOCABULARY = "pipesched_splits_vocabulary"
"""Attribute of a last layer whose logits are its tp rank's slice of the vocabulary (in tp
rank order, e.g. `pipeline.interop.hf_tensor_parallel`'s heads)."""


WHOLE_SEQUENCE = "pipesched_whole_sequence"
"""Method ``(whole: bool) -> None`` of a layer that holds 1/t of the sequence under sequence
parallelism: generation calls it with True before decoding and False after, so the layers
run over the whole sequence meanwhile (Megatron's inference: no sequence parallelism, the
same weights; e.g. `pipeline.interop.hf_modules_tp.SequenceSwitch`)."""


def _whole_sequence(inference: Inference, whole: bool) -> None:
    for module in inference.engine.module.modules():
        switch = getattr(module, WHOLE_SEQUENCE, None)
        if callable(switch):
            switch(whole)


def _choice(inference: Inference) -> Callable[[torch.Tensor], torch.Tensor]:
    """`_last_token_choice`, over the whole vocabulary when the last layer splits it over
    tp: only the last token's slices are gathered (b × vocab numbers), never all logits."""
    engine = inference.engine
    module = engine.module
    last_stage = module.total_stages - 1
    held = module.stage(last_stage).modules() if str(last_stage) in module.stages else ()
    splits = any(getattr(part, SPLITS_VOCABULARY, False) for part in held)
    if engine.groups is None or engine.topology.tp == 1 or not splits:
        return _last_token_choice
    group = engine.groups.tp_group

    def choose(logits: torch.Tensor) -> torch.Tensor:
        parts: list[Any] = [None] * engine.topology.tp
        dist.all_gather_object(parts, logits[:, -1, :].detach().cpu(), group=group)
        return torch.cat(parts, dim=-1).argmax(dim=-1)

    return choose


def greedy_generate(inference: Inference, input_ids: torch.Tensor, max_new_tokens: int, *,
                    attention_mask: torch.Tensor | None = None,
                    eos_token_id: int | Sequence[int] | None = None,
                    pad_token_id: int | None = None, use_cache: bool | None = None,
                    num_microbatches: int | None = None) -> torch.Tensor:
    """Append up to `max_new_tokens` greedy tokens to `input_ids` (b, seq) with a pipelined
    causal LM whose last stage returns logits (b, q, vocab); every rank of the pipeline gets
    the same tokens, those of HF's ``generate(do_sample=False)``.

    `attention_mask` marks real tokens (0 for left padding, prompts of different lengths).
    A row that produced an EOS token (any of `eos_token_id`; default, as HF's: the model's
    generation config, which `layers_from_hf`'s blocks carry) is padded with `pad_token_id`
    (default, as HF's: the generation config's pad id, else the first EOS id) from then
    on; generation stops when every row has. With
    `use_cache` (default: when the model's layers keep a decoding cache) each step after
    the prompt forwards only the new token; ``use_cache=False`` re-runs the sequence.
    """
    mask, eos = _checked(input_ids, max_new_tokens, attention_mask, eos_token_id,
                         pad_token_id)
    default_eos, default_pad = _generation_defaults(inference)
    if eos_token_id is None:
        eos = default_eos
    # HF: the pad id given, else the generation config's, else the first EOS id
    pad = next((token for token in (pad_token_id, default_pad) if token is not None),
               eos[0] if eos else 0)
    layers = _cached_layers(inference)
    supported = _pipeline_supports_cache(inference, bool(layers))
    if use_cache and not supported:
        raise PipelineConfigError(
            "greedy_generate(use_cache=True) needs layers that keep a decoding cache "
            "(pipeline.runtime.generation.CachedDecoding, as layers_from_hf's blocks do); "
            "this model has none: pass use_cache=False")
    cached = supported if use_cache is None else use_cache
    batch = input_ids.shape[0]
    rows = torch.arange(batch)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    tokens, unfinished = input_ids, torch.ones(batch, dtype=torch.bool)
    eos_ids = torch.tensor(eos, dtype=input_ids.dtype)
    for layer in layers:
        layer.reset_decoding_cache()
    choice = _choice(inference)
    _whole_sequence(inference, True)
    try:
        for step in range(max_new_tokens):
            if cached:  # the prompt once, then only the newest token
                new = slice(None) if step == 0 else slice(-1, None)
                x: Any = (tokens[:, new], mask, positions[:, new], rows)
            elif supported:
                x = (tokens, mask, positions)
            else:
                x = tokens if attention_mask is None else (tokens, mask)
            chosen = inference.eval_reduce(x, choice,
                                           num_microbatches=num_microbatches)
            next_token = chosen.to(tokens.dtype)
            if eos:
                next_token = torch.where(unfinished, next_token, pad)
            tokens = torch.cat([tokens, next_token[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = torch.cat([positions, positions[:, -1:] + 1], dim=1)
            if eos:
                unfinished &= ~torch.isin(next_token, eos_ids)
                if not bool(unfinished.any()):
                    break
    finally:
        _whole_sequence(inference, False)
        for layer in layers:
            layer.reset_decoding_cache()
    return tokens
