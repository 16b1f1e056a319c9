"""Mixture-of-experts weight names between transformers' checkpoints and its modules.

transformers 5 holds each MoE layer's experts fused and stacked (``mlp.experts.gate_up_proj``
[E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) but reads and writes checkpoints with one
tensor per expert, as the Hub's Mixtral / Qwen-MoE / OLMoE files are: Mixtral
``model.layers.N.block_sparse_moe.experts.E.w1/w2/w3.weight``, the others
``model.layers.N.mlp.experts.E.gate_proj/up_proj/down_proj.weight``. It converts on load
(``transformers.conversion_mapping``: a ``WeightConverter`` stacks the experts
(``MergeModulelist(dim=0)``) and concatenates gate and up (``Concatenate(dim=1)``); a
``WeightRenaming`` maps Mixtral's ``block_sparse_moe`` to ``mlp``) and reverts it on save.

That machinery works on whole tensors of a ``PreTrainedModel``; a pipeline rank holds some
layers and, with expert parallelism, some experts of each. So the same mapping is read here
(`moe_key_map`, from transformers' own table, so it follows the installed version) into
names per expert: a rank then reads exactly its experts' tensors, and an export writes the
names ``save_pretrained`` writes. A mapping that uses any other operation is refused, naming
it, rather than guessed.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import torch

from pipeline.errors import PipelineConfigError
from pipeline.interop.hf_moe_families import COVERED_MOE

__all__ = ["ExpertFusion", "MoEKeyMap", "moe_key_map"]

_EXPERT = "*"
"""Where a source pattern of transformers' mapping holds the expert index."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ExpertFusion:
    """One fused in-memory tensor and the per-expert checkpoint tensors it is made of."""

    target: str
    """The in-memory name's suffix, e.g. ``.experts.gate_up_proj``."""
    sources: tuple[str, ...]
    """Per-expert checkpoint name suffixes (``*``: the expert index, before renaming), in the
    order they are concatenated, e.g. (``.experts.*.w1.weight``, ``.experts.*.w3.weight``)."""
    dim: int
    """Dimension of one expert's tensor along which `sources` are concatenated."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MoEKeyMap:
    """A family's in-memory names <-> checkpoint names; legend: E experts, e one of them."""

    model_type: str
    """The config's ``model_type``."""
    renamings: tuple[tuple[str, str], ...]
    """(checkpoint, in-memory) substrings, e.g. (``.block_sparse_moe.``, ``.mlp.``)."""
    fusions: tuple[ExpertFusion, ...]
    """The fused expert tensors."""

    def fusion(self, key: str) -> ExpertFusion | None:
        """The fusion an in-memory name is made by, or None for a plain tensor."""
        return next((f for f in self.fusions if key.endswith(f.target)), None)

    def checkpoint_name(self, key: str) -> str:
        """The checkpoint name of an in-memory name that is not fused."""
        for on_disk, in_memory in self.renamings:
            key = key.replace(in_memory, on_disk)
        return key

    def expert_names(self, key: str, expert: int) -> tuple[str, ...]:
        """Checkpoint names of expert `expert`'s pieces of fused in-memory name `key`, in
        concatenation order."""
        fusion = self.fusion(key)
        if fusion is None:
            raise KeyError(f"{key} is not a fused expert tensor of {self.model_type}")
        prefix = key[:-len(fusion.target)]
        return tuple(self.checkpoint_name(prefix + source.replace(_EXPERT, str(expert)))
                     for source in fusion.sources)

    def join(self, key: str, experts: list[list[torch.Tensor]]) -> torch.Tensor:
        """Fused `key`'s rows from each expert's pieces (in `expert_names` order), stacked."""
        fusion = self.fusion(key)
        if fusion is None:
            raise KeyError(f"{key} is not a fused expert tensor of {self.model_type}")
        return torch.stack([torch.cat(pieces, dim=fusion.dim) for pieces in experts])

    def split(self, key: str, fused: torch.Tensor) -> dict[str, torch.Tensor]:
        """The checkpoint tensors of a whole fused `key` (every expert), contiguous."""
        fusion = self.fusion(key)
        if fusion is None:
            raise KeyError(f"{key} is not a fused expert tensor of {self.model_type}")
        out: dict[str, torch.Tensor] = {}
        for expert, rows in enumerate(fused):
            pieces = rows.chunk(len(fusion.sources), dim=fusion.dim)
            for name, piece in zip(self.expert_names(key, expert), pieces, strict=True):
                out[name] = piece.contiguous()
        return out

    def to_checkpoint(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A whole in-memory state dict under the names ``save_pretrained`` writes."""
        out: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            if self.fusion(key) is not None:
                out.update(self.split(key, value))
            else:
                out[self.checkpoint_name(key)] = value
        return out


def _literal(pattern: Any, model_type: str) -> str:
    """A renaming's pattern as a plain substring (dots literal); refuse real regexes."""
    if not isinstance(pattern, str) or not re.fullmatch(r"[\w.]+", pattern):
        raise PipelineConfigError(
            f"transformers' checkpoint mapping for {model_type!r} renames with {pattern!r}, "
            "which pipeline.interop.hf_moe_checkpoint does not map; pin transformers 5.x "
            "whose mapping renames plain substrings")
    return pattern


def _fusion(converter: Any, model_type: str) -> ExpertFusion:
    """The per-expert reading of one ``WeightConverter``: experts stacked along dim 0, then
    (with several sources) concatenated along a later dim."""
    ops = [(type(op).__name__, int(getattr(op, "dim", -1))) for op in converter.operations]
    sources, targets = list(converter.source_patterns), list(converter.target_patterns)
    stacked = ops[:1] == [("MergeModulelist", 0)]
    joined = ops[1:] == [] if len(sources) == 1 else (
        len(ops) == 2 and ops[1][0] == "Concatenate" and ops[1][1] >= 1)
    if not (stacked and joined and len(targets) == 1
            and all(isinstance(s, str) and s.count(_EXPERT) == 1 for s in sources)):
        raise PipelineConfigError(
            f"transformers' checkpoint mapping for {model_type!r} converts {sources} to "
            f"{targets} by {ops}; pipeline.interop.hf_moe_checkpoint reads only experts "
            "stacked along dim 0 (MergeModulelist(dim=0)), then concatenated "
            "(Concatenate(dim>=1)): pin the transformers 5.x this was tested with")
    return ExpertFusion(target=targets[0], sources=tuple(sources),
                        dim=ops[1][1] - 1 if len(ops) == 2 else 0)


def moe_key_map(model_type: str) -> MoEKeyMap | None:
    """The checkpoint mapping of a covered MoE family (`COVERED_MOE`), read from
    transformers' ``conversion_mapping``; None for any other model type (dense families keep
    their in-memory names on disk)."""
    if model_type not in COVERED_MOE:
        return None
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    renamings: list[tuple[str, str]] = []
    fusions: list[ExpertFusion] = []
    for transform in get_checkpoint_conversion_mapping(model_type) or []:
        kind = type(transform).__name__
        if kind == "WeightRenaming":
            for on_disk, in_memory in zip(transform.source_patterns,
                                          transform.target_patterns, strict=True):
                renamings.append((_literal(on_disk, model_type),
                                  _literal(in_memory, model_type)))
        elif kind == "WeightConverter":
            fusions.append(_fusion(transform, model_type))
        else:
            raise PipelineConfigError(
                f"transformers' checkpoint mapping for {model_type!r} holds a {kind}, which "
                "pipeline.interop.hf_moe_checkpoint does not map; pin transformers 5.x")
    if not fusions:
        raise PipelineConfigError(
            f"transformers' checkpoint mapping for {model_type!r} fuses no experts; this "
            "transformers stores them as the checkpoint does, which the MoE layers do not "
            "expect: use transformers 5.x")
    return MoEKeyMap(model_type=model_type, renamings=tuple(renamings), fusions=tuple(fusions))
