"""HF mixture-of-experts causal LMs as pipeline layers (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
DeepSeek-V2, DeepSeek-V3).

`pipeline.interop.hf_layers.layers_from_hf` hands these families here. Each decoder layer is
HF's own, with its ``mlp`` swapped for `pipeline.moe.layer.MoEFeedForward` holding HF's
router, stacked experts and (Qwen2-MoE) gated shared expert under HF's names, so weights
load and export as for the dense families; layers a family keeps dense
(``mlp_only_layers``, ``decoder_sparse_step``, ``first_k_dense_replace``) keep HF's MLP.
DeepSeek-V3 keeps HF's multi-head latent attention module and its router (with the
``e_score_correction_bias`` buffer its checkpoint holds); it balances "aux-free" by default,
moving that bias, as DeepSeek-V3 trained (HF's model adds no balancing loss: a step equals
HF's, only the bias moves after it; "none" keeps the bias fixed). DeepSeek-V2 keeps the same
attention with a softmax router (`pipeline.moe.routing.route`, greedy or group-limited, its
weights scaled by ``routed_scaling_factor``); HF's model adds no balancing loss, so it
balances "none" by default ("microbatch", "sequence" and "aux-free" are a choice).

The layer modules, the losses, and the legend of the value between stages:
`pipeline.interop.hf_moe_modules`.
"""

from __future__ import annotations

import copy
import functools
import importlib
from typing import Any

import torch
from torch import nn

from pipeline.errors import PipelineConfigError
from pipeline.interop.hf_moe_families import COVERED_MOE, LATENT_ATTENTION, deepseek_v2_problem
from pipeline.interop.hf_moe_modules import (
    BalancedSummedLoss,
    MoEBlock,
    MoEEmbedding,
    MoEFinalNorm,
    MoEHead,
    _moe_embed,
    _tied_moe_head,
    moe_causal_lm_loss,
)
from pipeline.interop.hf_recompute import mark_attention_cores
from pipeline.interop.hf_shared import HFLayers, _mask_function
from pipeline.model.layers import Layer, LayerSpec
from pipeline.model.tied import TiedLayerSpec
from pipeline.moe.balance_loss import BalanceLoss
from pipeline.moe.balancing import BalancingMethod, MoEBalancing, resolve_balancing
from pipeline.moe.capacity import DropPolicy
from pipeline.moe.expert_parallel import expert_parallel_problem
from pipeline.moe.layer import MoEFeedForward, RouterConfig

__all__ = ["MOE_FAMILIES", "MoEBlock", "moe_layers_from_hf", "router_config"]

MOE_FAMILIES = COVERED_MOE
"""model_type -> (``transformers.models.<module>``, class-name prefix)."""


def router_config(config: Any, capacity_factor: float | None = None,
                  drop_policy: DropPolicy = "probs") -> RouterConfig:
    """The family's routing: E experts, top-k, and whether the k weights are renormalised;
    dropless unless `capacity_factor` is given (`pipeline.moe.capacity`)."""
    mixtral = config.model_type == "mixtral"
    if config.model_type == "deepseek_v2":  # HF's router: softmax, never renormalised
        grouped = config.topk_method == "group_limited_greedy"
        return RouterConfig(num_experts=config.n_routed_experts,
                            top_k=config.num_experts_per_tok, normalize_top_k=False,
                            groups=config.n_group if grouped else 1,
                            top_groups=config.topk_group if grouped else 1,
                            scaling=float(config.routed_scaling_factor), fp32_logits=True,
                            capacity_factor=capacity_factor, drop_policy=drop_policy)
    if config.model_type == "deepseek_v3":
        return RouterConfig(num_experts=config.n_routed_experts,
                            top_k=config.num_experts_per_tok,
                            normalize_top_k=bool(config.norm_topk_prob), scoring="sigmoid",
                            groups=config.n_group, top_groups=config.topk_group,
                            scaling=float(config.routed_scaling_factor),
                            capacity_factor=capacity_factor, drop_policy=drop_policy)
    return RouterConfig(
        num_experts=config.num_local_experts if mixtral else config.num_experts,
        top_k=config.num_experts_per_tok,
        normalize_top_k=True if mixtral else bool(config.norm_topk_prob),
        capacity_factor=capacity_factor, drop_policy=drop_policy)


def _modeling(config: Any) -> Any:
    module = MOE_FAMILIES[config.model_type][0]
    return importlib.import_module(f"transformers.models.{module}.modeling_{module}")


def _class(config: Any, name: str) -> Any:
    return getattr(_modeling(config), MOE_FAMILIES[config.model_type][1] + name)


# -- building -------------------------------------------------------------------------------

def _embedding(config: Any) -> nn.Module:
    return nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)


def _untied_embedding(config: Any) -> nn.Module:
    return MoEEmbedding(_embedding(config))


def _block(config: Any, index: int, balance: BalanceLoss | None,
           routing: RouterConfig, balancing: MoEBalancing | None = None) -> nn.Module:
    layer = _class(config, "DecoderLayer")(config, index)
    mlp = layer.mlp
    if hasattr(mlp, "experts"):
        # HF allocates the stacked experts (and Qwen's router) uninitialised or zero and
        # leaves them to its post_init; initialise them as its _init_weights does, so a
        # model built from a config trains without loaded weights
        with torch.no_grad():
            for weight in (mlp.experts.gate_up_proj, mlp.experts.down_proj, mlp.gate.weight):
                weight.normal_(0.0, config.initializer_range)
        layer.mlp = MoEFeedForward(routing, mlp.gate, mlp.experts,
                                   shared_expert=getattr(mlp, "shared_expert", None),
                                   shared_expert_gate=getattr(mlp, "shared_expert_gate", None),
                                   shared_experts=getattr(mlp, "shared_experts", None),
                                   balance=balance, balancing=balancing,
                                   jitter_noise=float(getattr(mlp, "jitter_noise", 0.0) or 0.0))
    return MoEBlock(layer, config, _mask_function(config, index),
                    _class(config, "RotaryEmbedding")(config=config))


def _final_norm(config: Any) -> nn.Module:
    return MoEFinalNorm(_class(config, "RMSNorm")(config.hidden_size, eps=config.rms_norm_eps))


def _lm_head(config: Any) -> nn.Module:
    return MoEHead(nn.Linear(config.hidden_size, config.vocab_size, bias=False))


def _is_sparse(config: Any, index: int) -> bool:
    if config.model_type in ("mixtral", "olmoe"):  # every layer sparse
        return True
    if config.model_type in LATENT_ATTENTION:  # DeepSeek-V2 / V3
        return index >= config.first_k_dense_replace
    return index not in config.mlp_only_layers and (index + 1) % config.decoder_sparse_step == 0


MAX_EXPERT_ELEMENTS = 2 ** 40
"""One MoE layer's expert weights (E · 3 · hidden · expert width) above this would never be
allocated (4 TiB in fp32; DeepSeek-V3's are 1.1e10): refused before anything is built."""


def _size_problem(config: Any, experts: int) -> str | None:
    width = int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size)
    elements = experts * 3 * int(config.hidden_size) * width
    if elements <= MAX_EXPERT_ELEMENTS:
        return None
    return (f"{experts} experts of hidden {config.hidden_size} x width {width} are {elements:.3g} "
            f"weights per MoE layer, more than {MAX_EXPERT_ELEMENTS:.3g} that could ever be "
            "allocated: lower the expert count")


def _check(config: Any, expert_parallel: int, capacity_factor: float | None,
           drop_policy: DropPolicy, balancing: MoEBalancing) -> RouterConfig:
    """Refuse what would silently differ from HF, or could not be split, before any rank
    builds anything."""
    v2 = deepseek_v2_problem(config) if config.model_type == "deepseek_v2" else None
    if v2 is not None:
        raise PipelineConfigError(f"deepseek_v2: {v2}")
    try:
        routing = router_config(config, capacity_factor, drop_policy)
    except ValueError as error:
        raise PipelineConfigError(f"{config.model_type}: {error}") from error
    problem = (expert_parallel_problem(routing.num_experts, routing.top_k, expert_parallel)
               or _size_problem(config, routing.num_experts))
    if problem is not None:
        raise PipelineConfigError(f"{config.model_type}: {problem}")
    if config.model_type == "deepseek_v2" and balancing.method == "hf-batch":
        raise PipelineConfigError(
            "deepseek_v2 does not take 'hf-batch' balancing: HF's DeepSeek-V2 adds no "
            "balancing loss (even with output_router_logits); use 'none' (its default, the "
            "step equals HF's), 'microbatch', 'sequence' or 'aux-free'")
    if config.model_type == "deepseek_v3" and balancing.method not in ("aux-free", "none"):
        raise PipelineConfigError(
            f"{config.model_type} balances with 'aux-free' (its correction bias moves) or "
            f"'none', not {balancing.method!r}: HF's model adds no balancing loss, and the "
            "census-free losses read softmax probabilities, not its sigmoid scores")
    if balancing.method == "hf-batch":
        noisy = {name: getattr(config, name, 0.0) or 0.0
                 for name in ("router_jitter_noise", "attention_dropout")}
        noisy = {name: value for name, value in noisy.items() if value > 0}
        if noisy:
            raise PipelineConfigError(
                f"{config.model_type} with HF's whole-batch balancing loss ('hf-batch', "
                f"output_router_logits=True) and {noisy}: the loss is exact only when a "
                "census forward sees the routes the training forward takes "
                "(pipeline.moe.balance_loss); set them to 0.0, or balance with "
                "balancing='microbatch', 'sequence' or 'aux-free', which need no census")
    return routing


def moe_layers_from_hf(config: Any, *, attn_implementation: str | None = None,
                       expert_parallel: int = 1, capacity_factor: float | None = None,
                       drop_policy: DropPolicy = "probs",
                       balancing: MoEBalancing | BalancingMethod | None = None) -> HFLayers:
    """A HF MoE causal LM's config as pipeline layers (every layer a spec; load weights
    with `pipeline.interop.hf_weights.load_hf_weights`). `expert_parallel`: the engine's
    ep, checked here against the experts so a bad one fails before ranks start.
    `capacity_factor` (None: dropless, as HF) and `drop_policy`: token dropping as
    Megatron-Core's (`pipeline.moe.capacity`); HF has none, so a step then differs from HF's.

    `balancing` (`pipeline.moe.balancing.MoEBalancing` or a method's name; None: as the
    config says): with "hf-batch" (the default when the config sets
    ``output_router_logits``) the result's ``balance`` adds HF's load-balancing loss
    (``router_aux_loss_coef`` times it): train with
    `pipeline.moe.balance_loss.train_batch_balanced(engine, hf.balance, inputs, targets)`.
    "microbatch", "sequence", "aux-free" and "none" train with plain ``engine.train_batch``
    (the engine moves an aux-free bias after each step).
    """
    if balancing is None and config.model_type == "deepseek_v3":
        balancing = "aux-free"  # DeepSeek-V3's own; the step still equals HF's
    if balancing is None and config.model_type == "deepseek_v2":
        balancing = "none"  # HF's DeepSeek-V2 adds no balancing loss
    try:
        chosen = resolve_balancing(balancing, config)
    except ValueError as error:
        raise PipelineConfigError(f"{config.model_type}: {error}") from error
    routing = _check(config, expert_parallel, capacity_factor, drop_policy, chosen)
    config = copy.deepcopy(config)
    pretrained = _class(config, "PreTrainedModel")
    config._attn_implementation = (attn_implementation or config._attn_implementation
                                   or ("sdpa" if getattr(pretrained, "_supports_sdpa", True)
                                       else "eager"))
    balance = (BalanceLoss(routing.num_experts, float(chosen.aux_loss_coef or 0.0))
               if chosen.method == "hf-batch" else None)
    mark_attention_cores()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    make_embedding = functools.partial(_embedding, config)
    layers: list[Layer] = [TiedLayerSpec("embed_tokens", make_embedding, forward_fn=_moe_embed)
                           if tied else LayerSpec(_untied_embedding, config)]
    names = [("module." if tied else "embedding.", "model.embed_tokens.")]
    for index in range(config.num_hidden_layers):
        layers.append(LayerSpec(_block, config, index,
                                balance if _is_sparse(config, index) else None, routing,
                                chosen))
        names.append(("layer.", f"model.layers.{index}."))
    layers.append(LayerSpec(_final_norm, config))
    names.append(("norm.", "model.norm."))
    if tied:
        layers.append(TiedLayerSpec("embed_tokens", make_embedding, forward_fn=_tied_moe_head))
        names.append(("module.", "model.embed_tokens."))
    else:
        layers.append(LayerSpec(_lm_head, config))
        names.append(("head.", "lm_head."))
    return HFLayers(layers, moe_causal_lm_loss, tuple(names), config, BalancedSummedLoss(),
                    balance=balance, balancing=chosen)
