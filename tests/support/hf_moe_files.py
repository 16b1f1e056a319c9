"""What transformers' ``save_pretrained`` names a tiny MoE model's tensors, written out per family,
and a recorder of the tensors a process reads from safetensors files (test helper)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["checkpoint_names", "recording_reads"]

# Read off the files transformers 5.24's save_pretrained writes (one tensor per expert e;
# HF's modules fuse them as gate_up_proj = [gate; up] per expert, down_proj stacked):
#   mixtral              model.layers.N.block_sparse_moe.experts.e.w1 / w3 / w2.weight
#                        model.layers.N.block_sparse_moe.gate.weight
#   qwen2/3_moe, olmoe   model.layers.N.mlp.experts.e.gate_proj / up_proj / down_proj.weight
_EXPERTS = {
    "mixtral": {"gate_up_proj": ("block_sparse_moe.experts.{e}.w1.weight",
                                 "block_sparse_moe.experts.{e}.w3.weight"),
                "down_proj": ("block_sparse_moe.experts.{e}.w2.weight",)},
    "qwen": {"gate_up_proj": ("mlp.experts.{e}.gate_proj.weight",
                              "mlp.experts.{e}.up_proj.weight"),
             "down_proj": ("mlp.experts.{e}.down_proj.weight",)},
}


def checkpoint_names(family: str, key: str, experts: range) -> list[str]:
    """The names ``save_pretrained`` gives in-memory name `key` (a fused expert tensor: the
    pieces of `experts` only, in gate-then-up order)."""
    table = _EXPERTS["mixtral" if family == "mixtral" else "qwen"]
    fused = re.fullmatch(r"(model\.layers\.\d+\.)mlp\.experts\.(gate_up_proj|down_proj)", key)
    if fused:
        return [fused.group(1) + name.format(e=e) for e in experts
                for name in table[fused.group(2)]]
    if family == "mixtral":
        return [re.sub(r"^(model\.layers\.\d+\.)mlp\.", r"\1block_sparse_moe.", key)]
    return [key]


@contextmanager
def recording_reads() -> Iterator[list[str]]:
    """Within the block, every tensor read through ``safetensors.safe_open`` (``get_tensor``
    or ``get_slice``) is appended to the yielded list (headers, ``keys()``, are not reads)."""
    import safetensors

    reads: list[str] = []
    opened = safetensors.safe_open

    class Recording:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.handle = opened(*args, **kwargs)

        def __enter__(self) -> Recording:
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *args: Any) -> None:
            self.handle.__exit__(*args)

        def keys(self) -> Any:
            return self.inner.keys()

        def get_tensor(self, key: str) -> Any:
            reads.append(key)
            return self.inner.get_tensor(key)

        def get_slice(self, key: str) -> Any:
            reads.append(key)
            return self.inner.get_slice(key)

    safetensors.safe_open = Recording  # type: ignore[assignment,misc]
    try:
        yield reads
    finally:
        safetensors.safe_open = opened  # type: ignore[misc]
