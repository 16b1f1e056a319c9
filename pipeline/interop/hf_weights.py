"""HF weights in and out of a pipeline: load a local checkpoint on the owning rank only, export
the pipelined parameters back to a HF state dict."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeline.errors import PipelineConfigError
from pipeline.interop.hf_checkpoint_reader import (
    ExpertRows,
    Want,
    read_pieces,
    read_wanted,
    tensor_source,
)
from pipeline.interop.hf_layers import HFLayers
from pipeline.interop.hf_moe_checkpoint import moe_key_map
from pipeline.interop.hf_moe_families import CHECKPOINT_BUFFERS
from pipeline.model.build_context import current_process_groups
from pipeline.model.module import PipelineModule
from pipeline.moe.expert_parallel import expert_parallel_problem, local_experts
from pipeline.parallel.param_marks import expert_shard
from pipeline.parallel.tensor.shard_layout import ShardLayout, layout_of, mark_sharded

__all__ = ["checkpoint_tensors", "gather_hf_state_dict", "hf_checkpoint_tensors",
           "hf_state_dict", "load_hf_weights", "read_hf_tensors", "save_hf_checkpoint"]

WeightSource = str | Path | Mapping[str, torch.Tensor]
"""A local HF checkpoint directory (``model.safetensors`` or a sharded index), or a state
dict (``hf_model.state_dict()``)."""


def read_hf_tensors(directory: str | Path, keys: list[str],
                    layouts: Mapping[str, ShardLayout] | None = None) -> dict[str, torch.Tensor]:
    """Only `keys` (checkpoint names) from the safetensors files of a local checkpoint
    directory (each file is opened lazily: tensors this rank does not hold are never read);
    a key with a layout in `layouts` (a tensor-parallel slice) reads only this rank's rows
    (safetensors ``get_slice``), not the whole tensor."""
    return read_pieces(tensor_source(directory), keys, layouts or {})


def checkpoint_tensors(module: PipelineModule
                       ) -> Iterator[tuple[tuple[int, str], torch.Tensor]]:
    """`module.named_layer_parameters()`, then the buffers HF's checkpoints hold too
    (`CHECKPOINT_BUFFERS`, e.g. DeepSeek-V3's ``e_score_correction_bias``), keyed alike."""
    yield from module.named_layer_parameters()
    for index in sorted(int(key) for key in module.stages):
        for key, layer in module.stage(index).layers.items():
            for name, buffer in layer.named_buffers():
                if name.rsplit(".", 1)[-1] in CHECKPOINT_BUFFERS:
                    yield (int(key), name), buffer


def _want(param: torch.Tensor, fused: bool) -> tuple[Want, range | None]:
    """What to read for `param`, and which of its experts (dim-0 rows) the read fills (None:
    all of it). A fused expert tensor not yet split by expert parallelism, built by an
    engine with ep > 1 (its groups are current while the load hook runs), reads only the
    experts this rank keeps (`parallelize_experts` slices them out next)."""
    layout = layout_of(param)
    shard = expert_shard(param)
    if shard is not None:
        return Want(layout, ExpertRows(shard[0], shard[0] + param.shape[0], shard[1])), None
    if not fused:
        return Want(layout, None), None
    total = param.shape[0]
    groups = current_process_groups()
    ep = groups.topology.ep if groups is not None else 1
    if groups is None or ep == 1 or expert_parallel_problem(total, 1, ep) is not None:
        return Want(layout, ExpertRows(0, total, total)), None
    kept = local_experts(total, ep, groups.position.ep_rank)
    return Want(layout, ExpertRows(kept.start, kept.stop, total)), kept


def _load_now(module: PipelineModule, hf: HFLayers, source: WeightSource) -> list[str]:
    key_map = moe_key_map(hf.config.model_type)
    held = list(checkpoint_tensors(module))
    keys = [hf.hf_name(layer, name) for (layer, name), _ in held]
    wants, fills = {}, {}
    for ((_, _), param), key in zip(held, keys):
        wants[key], fills[key] = _want(param, key_map is not None
                                       and key_map.fusion(key) is not None)
    tensors = read_wanted(tensor_source(source), wants, key_map)
    problems = []
    with torch.no_grad():
        for ((layer, name), param), key in zip(held, keys):
            value, kept = tensors[key], fills[key]
            target = param if kept is None else param[kept.start:kept.stop]
            if tuple(value.shape) != tuple(target.shape):
                problems.append(f"{key}: shape {tuple(value.shape)} in the checkpoint, "
                                f"{tuple(target.shape)} in layer {layer} ({name})")
                continue
            target.copy_(value.to(param.dtype))
            if kept is not None:  # experts another ep rank keeps: NaN, loud if ever used
                param[:kept.start].fill_(float("nan"))
                param[kept.stop:].fill_(float("nan"))
    if problems:
        raise PipelineConfigError("HF weights do not fit: " + "; ".join(problems) + "; build "
                                  "the layers from the checkpoint's own config")
    return sorted(set(keys))


def load_hf_weights(module: PipelineModule, hf: HFLayers, source: WeightSource) -> None:
    """Copy HF weights into the parameters of this rank's stages, reading only those.

    Before the engine exists (the usual order) the copy runs when the engine builds this
    rank's stages, so the optimizer (and ZeRO-1's fp32 masters) start from the loaded
    weights; on a module already built it runs at once: build the engine afterwards.
    """
    if not isinstance(module, PipelineModule):
        raise TypeError(f"load_hf_weights needs a PipelineModule, got {type(module).__name__}")
    def load(built: PipelineModule) -> None:
        _load_now(built, hf, source)

    module.on_materialize(load)


def hf_state_dict(module: PipelineModule, hf: HFLayers) -> dict[str, torch.Tensor]:
    """This rank's parameters under their HF names (detached CPU copies; a tensor-parallel
    slice is this rank's slice, `layout_of` it says which; an expert-parallel shard holds only
    this rank's experts: `gather_hf_state_dict` joins both). Collective under ZeRO-3 or
    overlapped parameter gathers: the module's state-dict hooks complete the gathers first
    (a ZeRO-3 layer between uses has no storage to read)."""
    module.state_dict()
    return {hf.hf_name(layer, name): _with_layout(param.detach().cpu().clone(), param)
            for (layer, name), param in checkpoint_tensors(module)}


def _with_layout(copy: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    layout = layout_of(param)
    if layout is not None:
        mark_sharded(copy, layout)
    return copy


def _merge(parts: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """One state dict from every rank's: whole tensors as they are, tp slices merged."""
    merged: dict[str, torch.Tensor] = {}
    slices: dict[str, dict[int, tuple[ShardLayout, torch.Tensor]]] = {}
    for part in parts:
        for key, (value, layout) in part.items():
            if layout is None:
                merged[key] = value
            else:
                slices.setdefault(key, {})[layout.rank] = (layout, value)
    for key, by_rank in slices.items():
        layout = by_rank[0][0]
        merged[key] = layout.merge([by_rank[r][1] for r in range(layout.size)])
    return merged


def gather_hf_state_dict(module: PipelineModule, hf: HFLayers) -> dict[str, torch.Tensor]:
    """The whole model's HF state dict on every rank (a collective over the default group);
    tensor-parallel slices are merged back into whole tensors.

    A tied lm_head appears under ``lm_head.weight`` too, as ``hf_model.state_dict()`` has
    it, so ``hf_model.load_state_dict(gather_hf_state_dict(...))`` loads strictly.
    """
    shards = {hf.hf_name(layer, name): shard
              for (layer, name), param in module.named_layer_parameters()
              if (shard := expert_shard(param)) is not None}
    parts: list[Any] = [None] * dist.get_world_size()
    mine = {key: (value, layout_of(value)) for key, value in hf_state_dict(module, hf).items()}
    dist.all_gather_object(parts, (mine, shards))
    merged = _merge([{key: value for key, value in state.items() if key not in starts}
                     for state, starts in parts])
    # expert-parallel shards (each maybe tp slices, expert_tensor_parallel > 1): each
    # shard's slices merged, then the experts in order along dim 0
    pieces: dict[str, dict[int, list[tuple[torch.Tensor, ShardLayout | None]]]] = {}
    for state, starts in parts:
        for key, value in state.items():
            if key in starts:
                pieces.setdefault(key, {}).setdefault(starts[key][0], []).append(value)
    for key, by_first in pieces.items():
        merged[key] = torch.cat([_merge([{key: one} for one in by_first[first]])[key]
                                 for first in sorted(by_first)])
    tied_key = hf.names[-1][1] + "weight"
    if tied_key != "lm_head.weight" and tied_key in merged:
        merged["lm_head.weight"] = merged[tied_key]
    return merged


def hf_checkpoint_tensors(state: Mapping[str, torch.Tensor], hf: HFLayers
                          ) -> dict[str, torch.Tensor]:
    """A whole HF state dict (`gather_hf_state_dict`) as the tensors ``save_pretrained``
    writes: a tied ``lm_head.weight`` left out, a mixture-of-experts family's fused experts
    as one tensor per expert under its checkpoint names (`pipeline.interop.hf_moe_checkpoint`),
    each contiguous."""
    tied = hf.names[-1][1] != "lm_head."
    tensors = {key: value.contiguous() for key, value in state.items()
               if not (tied and key == "lm_head.weight")}
    key_map = moe_key_map(hf.config.model_type)
    return tensors if key_map is None else key_map.to_checkpoint(tensors)


def save_hf_checkpoint(module: PipelineModule, hf: HFLayers, directory: str | Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` that ``from_pretrained(directory)``
    loads with no missing or unexpected key (a collective; global rank 0 writes), holding the
    names ``save_pretrained`` writes (`hf_checkpoint_tensors`)."""
    from safetensors.torch import save_file

    state = gather_hf_state_dict(module, hf)
    if dist.get_rank() == 0:
        Path(directory).mkdir(parents=True, exist_ok=True)
        save_file(hf_checkpoint_tensors(state, hf), str(Path(directory) / "model.safetensors"),
                  metadata={"format": "pt"})
        hf.config.save_pretrained(str(directory))
    dist.barrier()
