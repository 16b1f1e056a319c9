"""MoE checkpoints as transformers writes them: each family loads from a `save_pretrained`
directory (one file or small shards) exactly, reading only its stage's tensors; the export
holds the names `save_pretrained` writes and `from_pretrained` loads it with nothing missing
or unexpected; a planted gate/up swap in the name map fails both."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from pipeline import PipelineModule
from pipeline.errors import PipelineConfigError
from pipeline.interop import hf_moe_checkpoint, hf_weights
from pipeline.interop.hf_layers import layers_from_hf
from pipeline.interop.hf_moe_checkpoint import moe_key_map
from pipeline.interop.hf_weights import hf_checkpoint_tensors, hf_state_dict, load_hf_weights
from tests.support.hf_moe_files import checkpoint_names, recording_reads
from tests.support.hf_moe_models import MOE_FAMILIES, tiny_moe_config, tiny_moe_model

SHARD = "20KB"
"""Small enough that the tiny models' experts spread over several files."""


def _saved(tmp_path: Path, family: str, sharded: bool, **options: Any) -> tuple[Any, Path]:
    model = tiny_moe_model(family, seed=3, **options)
    model.save_pretrained(tmp_path, **({"max_shard_size": SHARD} if sharded else {}))
    index = tmp_path / "model.safetensors.index.json"
    if sharded:  # the layers' experts really are spread over files
        assert len(set(json.loads(index.read_text())["weight_map"].values())) > 2
    else:
        assert not index.exists()
    return model, tmp_path


def _loaded(family: str, source: Any, stage: int, **options: Any
            ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Stage `stage` of 2 loaded from `source`: its HF-named tensors, and the names read."""
    hf = layers_from_hf(tiny_moe_config(family, **options))
    module = PipelineModule(hf.layers, num_stages=2, loss_fn=hf.loss_fn,
                            partition_method="uniform")
    load_hf_weights(module, hf, source)
    with recording_reads() as reads:
        module.materialize([stage])
    return hf_state_dict(module, hf), reads


def _differences(loaded: dict[str, torch.Tensor], model: Any) -> list[str]:
    reference = model.state_dict()
    return [key for key, value in loaded.items() if not torch.equal(value, reference[key])]


@contextmanager
def _planted(bug: str) -> Iterator[None]:
    """Planted bug in the name map: Mixtral's w1 (gate) and w3 (up) swapped."""
    assert bug == "w1 and w3 swapped"
    real = moe_key_map

    def swapped(model_type: str) -> Any:
        key_map = real(model_type)
        fusions = tuple(dataclasses.replace(f, sources=f.sources[::-1]) for f in key_map.fusions)
        return dataclasses.replace(key_map, fusions=fusions)

    saved = hf_weights.moe_key_map
    hf_weights.moe_key_map = swapped  # type: ignore[assignment]
    try:
        yield
    finally:
        hf_weights.moe_key_map = saved


def test_the_name_map_is_what_save_pretrained_writes() -> None:
    """transformers' own conversion table read per expert equals the names written out by
    hand from its files (`tests.support.hf_moe_files`)."""
    for family in MOE_FAMILIES:
        key_map = moe_key_map(family)
        assert key_map is not None
        for suffix in ("gate_up_proj", "down_proj"):
            key = f"model.layers.1.mlp.experts.{suffix}"
            assert [n for e in range(4) for n in key_map.expert_names(key, e)] \
                == checkpoint_names(family, key, range(4))
        for key in ("model.layers.1.mlp.gate.weight", "model.layers.0.self_attn.q_proj.weight"):
            assert [key_map.checkpoint_name(key)] == checkpoint_names(family, key, range(0))
    assert moe_key_map("llama") is None  # dense families keep their names


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_each_stage_loads_exactly_its_tensors_from_save_pretrained(
        tmp_path: Path, family: str, sharded: bool) -> None:
    model, directory = _saved(tmp_path, family, sharded)
    for stage in (0, 1):
        loaded, reads = _loaded(family, directory, stage)
        assert _differences(loaded, model) == [], (family, stage)
        expected = [name for key in loaded for name in checkpoint_names(family, key, range(4))]
        assert sorted(reads) == sorted(expected), (family, stage)  # each once, nothing else


def test_an_older_export_with_fused_names_still_loads(tmp_path: Path) -> None:
    """pipesched's exports before this change held the in-memory (fused) names."""
    from safetensors.torch import save_file

    model = tiny_moe_model("mixtral", seed=3)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(tmp_path / "model.safetensors"))
    loaded, _ = _loaded("mixtral", tmp_path, 0)
    assert _differences(loaded, model) == []


def _export(tmp_path: Path, family: str, **options: Any) -> tuple[dict[str, torch.Tensor], Path]:
    """Both stages loaded, their weights replaced by new random values, written as
    `save_hf_checkpoint` writes them: the pipeline's HF state and the directory."""
    from safetensors.torch import save_file

    config = tiny_moe_config(family, **options)
    hf = layers_from_hf(config)
    module = PipelineModule(hf.layers, num_stages=1, loss_fn=hf.loss_fn)
    module.materialize([0])
    with torch.no_grad():
        for _, param in module.named_layer_parameters():
            param.normal_()
    state = hf_state_dict(module, hf)
    tmp_path.mkdir(parents=True)
    save_file(hf_checkpoint_tensors(state, hf), str(tmp_path / "model.safetensors"))
    config.save_pretrained(tmp_path)
    return state, tmp_path


@pytest.mark.parametrize(("family", "tied"), [(f, False) for f in MOE_FAMILIES]
                         + [("qwen3_moe", True)])
def test_the_export_is_what_save_pretrained_writes(tmp_path: Path, family: str,
                                                   tied: bool) -> None:
    import transformers
    from safetensors import safe_open

    state, directory = _export(tmp_path / "ours", family, tied=tied)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}  # nothing missing, unexpected, ...
    assert _differences(state, reloaded) == []
    tiny_moe_model(family, tied=tied).save_pretrained(tmp_path / "theirs")
    with safe_open(str(directory / "model.safetensors"), "pt") as ours, \
            safe_open(str(tmp_path / "theirs" / "model.safetensors"), "pt") as theirs:
        assert set(ours.keys()) == set(theirs.keys())


def test_a_planted_gate_up_swap_fails_the_load_and_the_export(tmp_path: Path) -> None:
    import transformers

    model, directory = _saved(tmp_path / "saved", "mixtral", True)
    with _planted("w1 and w3 swapped"):
        loaded, _ = _loaded("mixtral", directory, 0)
        state, exported = _export(tmp_path / "ours", "mixtral")
    assert any("gate_up_proj" in key for key in _differences(loaded, model))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported)
    assert any("gate_up_proj" in key for key in _differences(state, reloaded))


def test_more_experts_in_the_checkpoint_than_the_config_is_one_error(tmp_path: Path) -> None:
    import transformers

    config = tiny_moe_config("olmoe")
    config.num_experts = 8
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(PipelineConfigError, match=r"experts\.4\.gate_proj.*more than the "
                                                  r"config's 4 experts"):
        _loaded("olmoe", tmp_path, 0)


def test_a_missing_expert_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tiny_moe_model("qwen3_moe").save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.0.mlp.experts.2.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(PipelineConfigError, match=r"lacks \['model\.layers\.0\.mlp\.experts"
                                                  r"\.2\.up_proj\.weight'\]"):
        _loaded("qwen3_moe", tmp_path, 0)


def test_a_conversion_this_reader_does_not_know_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import conversion_mapping
    from transformers.core_model_loading import Transpose, WeightConverter

    converter = WeightConverter(source_patterns="mlp.experts.*.down_proj.weight",
                                target_patterns="mlp.experts.down_proj",
                                operations=[Transpose(0, 1)])
    monkeypatch.setattr(conversion_mapping, "get_checkpoint_conversion_mapping",
                        lambda model_type: [converter])
    with pytest.raises(PipelineConfigError, match=r"'olmoe'.*Transpose.*MergeModulelist"):
        hf_moe_checkpoint.moe_key_map("olmoe")
