"""Cut a loaded HF block's projections (attention, MLP, GPT-2) into this rank's slices."""

from __future__ import annotations

import copy
from typing import Any

from pipeline.interop.hf_modules_tp import HeadRows, Region, RowParallel, shard_parameter
from pipeline.parallel.tensor.collectives import tp_rank_and_size
from pipeline.parallel.tensor.sequence import sum_gradient_over_tensor_parallel

__all__ = ["column_names", "head_shape", "split_attention", "split_gpt2",
           "split_latent_attention", "split_mlp"]


def head_shape(config: Any) -> tuple[int, int, int]:
    """(query heads, key/value heads, FFN width) of a supported config."""
    if config.model_type == "gpt2":
        ffn = config.n_inner or 4 * config.n_embd
        return config.n_head, config.n_head, ffn
    heads = config.num_attention_heads
    return heads, getattr(config, "num_key_value_heads", None) or heads, \
        config.intermediate_size


def column_names(module: Any) -> tuple[str, ...]:
    """The column-parallel projections a split attention or MLP calls on its input."""
    for names in (("c_attn",), ("c_fc",), ("qkv_proj",), ("gate_up_proj",),
                  ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
        if all(hasattr(module, name) for name in names):
            return names
    raise TypeError(f"{type(module).__name__} has none of the column-parallel projections "
                    "tensor_parallel_hf knows")


def _column(linear: Any, blocks: tuple[int, ...], region: Region, *,
            transposed: bool = False) -> None:
    """Keep this rank's output features of `linear` (a Linear, or a Conv1D if `transposed`)."""
    linear.weight = shard_parameter(linear.weight, 1 if transposed else 0, blocks,
                                    region.group)
    if linear.bias is not None:
        linear.bias = shard_parameter(linear.bias, 0, blocks, region.group)
    width = sum(blocks) // tp_rank_and_size(region.group)[1]
    setattr(linear, "nf" if transposed else "out_features", width)


def split_attention(attention: Any, config: Any, region: Region, rank: int,
                    size: int) -> None:
    heads, kv_heads, _ = head_shape(config)
    head_dim = attention.head_dim
    local_kv = kv_heads // size if kv_heads % size == 0 else 1
    if hasattr(attention, "qkv_proj"):  # Phi-3: Q;K;V fused
        _column(attention.qkv_proj, (heads * head_dim, kv_heads * head_dim,
                                     kv_heads * head_dim), region)
    else:
        _column(attention.q_proj, (heads * head_dim,), region)
        for name in ("k_proj", "v_proj"):
            linear = getattr(attention, name)
            if kv_heads % size == 0:
                _column(linear, (kv_heads * head_dim,), region)
            else:  # each kv head serves size // kv_heads consecutive ranks
                head = rank // (size // kv_heads)
                setattr(attention, name, HeadRows(
                    linear, slice(head * head_dim, (head + 1) * head_dim), region.group))
    attention.o_proj = RowParallel(attention.o_proj, region)
    for name in ("q_norm", "k_norm"):  # per-head norms shared by the heads of every rank
        norm = getattr(attention, name, None)
        if norm is not None:
            for param in norm.parameters():
                sum_gradient_over_tensor_parallel(param, region.group)
    attention.num_key_value_groups = (heads // size) // local_kv
    if hasattr(attention, "num_key_value_heads"):
        attention.num_key_value_heads = local_kv
    attention.config = copy.copy(attention.config)  # Phi-3 cuts its fused output by these
    attention.config.num_attention_heads = heads // size
    attention.config.num_key_value_heads = local_kv


def split_latent_attention(attention: Any, config: Any, region: Region) -> None:
    """DeepSeek's multi-head latent attention by heads: the up-projections (``q_b_proj``, or
    ``q_proj`` without a q rank, and ``kv_b_proj``) keep this rank's heads' rows, ``o_proj``
    their columns; the low-rank down-projections ``q_a_proj`` / ``kv_a_proj_with_mqa`` (the
    latent and the shared rotary key) and their norms stay whole, their gradients summed
    over tp (each rank's heads contribute a part)."""
    heads = config.num_attention_heads
    query = attention.q_proj if attention.q_proj is not None else attention.q_b_proj
    _column(query, (heads * attention.qk_head_dim,), region)
    _column(attention.kv_b_proj, (heads * (attention.qk_nope_head_dim + attention.v_head_dim),),
            region)
    attention.o_proj = RowParallel(attention.o_proj, region)
    for name in ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm"):
        part = getattr(attention, name, None)
        if part is not None:
            for param in part.parameters():
                sum_gradient_over_tensor_parallel(param, region.group)
    attention.num_heads = heads // tp_rank_and_size(region.group)[1]


def split_mlp(mlp: Any, region: Region) -> None:
    if hasattr(mlp, "gate_up_proj"):  # Phi-3: gate;up fused
        width = mlp.gate_up_proj.out_features // 2
        _column(mlp.gate_up_proj, (width, width), region)
    else:
        _column(mlp.gate_proj, (mlp.gate_proj.out_features,), region)
        _column(mlp.up_proj, (mlp.up_proj.out_features,), region)
    mlp.down_proj = RowParallel(mlp.down_proj, region)


def split_gpt2(block: Any, config: Any, region: Region) -> None:
    attention, mlp = block.attn, block.mlp
    width = config.n_embd
    size = tp_rank_and_size(region.group)[1]
    _column(attention.c_attn, (width, width, width), region, transposed=True)
    attention.split_size = width // size
    attention.num_heads = config.n_head // size
    attention.c_proj = RowParallel(attention.c_proj, region, transposed=True)
    _column(mlp.c_fc, (mlp.c_fc.nf,), region, transposed=True)
    mlp.c_proj = RowParallel(mlp.c_proj, region, transposed=True)
