"""Activation bytes one Hugging Face decoder layer keeps for its backward when its eager modules
run split over tensor parallelism (the engine's `tensor_parallel_hf`), counted per tensor.

`accounting.layer_activation_bytes` prices Megatron's kernels (Korthikanti et al. 2022); a HF
layer keeps other tensors, so the same shape holds more (fp32, tiny Llama / GPT-2, tp 2, with
sequence parallelism: +62 % / +74 % against Korthikanti). What each module saves, read off
autograd's saved tensors (`SavedTensorMeter`) with torch 2.13 and transformers 5:

    RMSNorm     its input and the normalized tensor before the weight (n·h each) and
                rsqrt (n); LayerNorm: its input (n·h), mean and rstd (2n, fp32)
    q/k/v, MLP  the input of each column-parallel region (n·h, twice a layer): with
    inputs      sequence parallelism this rank's slice, gathered again in the backward
                (Megatron's way; `pipeline.parallel.tensor.overlap.column_parallel_linear`)
    rotary      cos and sin (s·b·d each; q·cos and rotate(q)·sin save only these)
    attention   the fused kernel's (SDPA) q, k, v (s·b·(q + 2k)/t) and output (s·b·q/t),
                its log-sum-exp per row and head (s·b·a/t, fp32)
    MLP         `mlp_tensors` tensors of s·b·f/t: SwiGLU / GeGLU 4 (gate, act(gate), up,
                their product), GPT-2's python `gelu_new` 5, a fused GELU 2
    dropout     none (every probability 0, as the families' current configs)

n is the tokens a rank's norms see: s·b, or s·b/t with sequence parallelism.
`eager_core_bytes` is what selective recomputation drops (`recompute_region` around the
attention core keeps its q, k and v, the region's inputs). Pure, no torch.
"""

from __future__ import annotations

from typing import Literal

from schedules.ir.errors import ScheduleConfigError

__all__ = ["EagerNorm", "eager_core_bytes", "eager_layer_activation_bytes"]

EagerNorm = Literal["rmsnorm", "layernorm"]
_FP32 = 4


def eager_layer_activation_bytes(s: int, b: int, h: int, a: int, *, q_width: int,
                                 kv_width: int, ffn: int, head_dim: int,
                                 norm: EagerNorm = "rmsnorm", rotary: bool = True,
                                 mlp_tensors: int = 4, t: int = 1,
                                 sequence_parallel: bool = False) -> float:
    """Bytes one fp32 HF decoder layer (pre-norm attention and MLP, no recomputation, no
    dropout) keeps per tp rank, every term from the table in the module docstring.

    `q_width` (a·d) and `kv_width` (kv heads·d) are the query and key widths, `ffn` f,
    `head_dim` d; `t` the tp size, which must divide the heads and key/value heads (each
    rank's slices are 1/t of them)."""
    for name, value in (("s", s), ("b", b), ("h", h), ("a", a), ("q_width", q_width),
                        ("kv_width", kv_width), ("ffn", ffn), ("head_dim", head_dim),
                        ("t", t)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleConfigError(f"{name} must be an int >= 1, got {value!r}")
    if norm not in ("rmsnorm", "layernorm"):
        raise ScheduleConfigError(f"norm must be 'rmsnorm' or 'layernorm', got {norm!r}")
    if isinstance(mlp_tensors, bool) or not isinstance(mlp_tensors, int) or mlp_tensors < 0:
        raise ScheduleConfigError(f"mlp_tensors must be an int >= 0, got {mlp_tensors!r}")
    tokens = s * b
    n = tokens / t if sequence_parallel else tokens
    per_norm = n * h * (2 if norm == "rmsnorm" else 1) + n * (1 if norm == "rmsnorm" else 2)
    elements = (2 * per_norm                                   # the two norms
                + 2 * n * h                                    # column regions' inputs
                + (2 * tokens * head_dim if rotary else 0)     # cos, sin
                + tokens * (2 * q_width + 2 * kv_width) / t    # q, k, v, output
                + tokens * a / t                               # log-sum-exp
                + mlp_tensors * tokens * ffn / t)              # the MLP's tensors
    return _FP32 * elements


def eager_core_bytes(s: int, b: int, a: int, *, t: int = 1) -> float:
    """Bytes selective recomputation drops of a fp32 HF layer per tp rank: the fused attention
    kernel's log-sum-exp (its q, k, v stay as the checkpointed region's inputs, its output as
    the output projection's input)."""
    return _FP32 * s * b * a / t
