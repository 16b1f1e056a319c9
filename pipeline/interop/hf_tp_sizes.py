"""Which tensor-parallel sizes `tensor_parallel_hf` can split an HF config over."""

from __future__ import annotations

from typing import Any

from pipeline.errors import PipelineConfigError
from pipeline.interop.hf_moe_families import COVERED_MOE
from pipeline.interop.hf_moe_tp import dense_ffn_width
from pipeline.interop.hf_tp_split import head_shape

__all__ = ["check_tensor_parallel_size", "valid_tensor_parallel_sizes"]


def _size_problems(config: Any, tp: int) -> list[str]:
    heads, kv_heads, ffn = head_shape(config)
    moe = config.model_type in COVERED_MOE
    problems = []
    if heads % tp:
        problems.append(f"{heads} attention heads")
    if kv_heads % tp and (tp % kv_heads or config.model_type == "phi3"):
        problems.append(f"{kv_heads} key/value heads (" + (
            "Phi-3's fused qkv_proj: tp must divide them)" if config.model_type == "phi3"
            else "tp must divide them or be a multiple of them)"))
    if moe:  # the experts stay whole (expert tensor parallelism 1): only dense MLPs split
        ffn = dense_ffn_width(config) or tp
    if ffn % tp:
        problems.append(f"FFN width {ffn}")
    return problems


def valid_tensor_parallel_sizes(config: Any, up_to: int = 64) -> list[int]:
    """The tp sizes up to `up_to` that `tensor_parallel_hf` can split `config` over (the
    vocabulary splits over any tp: its parts may differ by one row)."""
    return [tp for tp in range(1, up_to + 1) if not _size_problems(config, tp)]


def check_tensor_parallel_size(config: Any, tp: int) -> None:
    """Raise `PipelineConfigError` (one line: the value, what it does not divide, the valid
    sizes) when `tensor_parallel_hf` cannot split `config` over `tp` ranks."""
    problems = _size_problems(config, tp)
    if problems:
        valid = valid_tensor_parallel_sizes(config)
        raise PipelineConfigError(
            f"tensor parallel size {tp} does not divide {config.model_type}'s "
            f"{'; '.join(problems)}; valid tensor parallel sizes: "
            f"{', '.join(map(str, valid))}")
