"""`load_model` of a HF config prices its blocks as this engine runs them (HF's eager modules,
`hf_activations`): per-layer bytes equal `eager_layer_activation_bytes` and the bytes autograd
saves for a tiny HF block (counted here), under no, selective and full recomputation; the
Korthikanti pricing (a planted bug) fails that count; a plan it would have accepted is
refused for memory, or changed."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch

from pipeline.interop.hf_layers import layers_from_hf
from pipeline.planner import PRESETS, PlanError, SearchOptions, load_model, plan
from pipeline.planner.hf_activations import UNCOVERED, eager_block_bytes
from pipeline.planner.hf_config import FAMILIES, shape_from_hf_config
from pipeline.planner.profile import LayerProfile, ModelProfile
from pipeline.recompute_region import selective_recompute
from schedules.analysis.eager_activations import eager_layer_activation_bytes
from tests.support.hf_models import tiny_config

SEQ, BATCH = 16, 2


def _config_dir(tmp_path: Path, config: Any) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    return str(tmp_path)


def _block(profile: ModelProfile) -> LayerProfile:
    return next(layer for layer in profile.layers if layer.name.startswith("block"))


def _counted(config: Any, selective: bool) -> int:
    """Bytes of the distinct storages autograd saves for one block of `config` (parameters
    left out) on a (BATCH, SEQ) batch: the oracle, from the definition of what the backward
    holds."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    hf = layers_from_hf(config)
    block = hf.layers[2 if config.model_type == "gpt2" else 1].build()
    weights = {p.untyped_storage().data_ptr() for p in block.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    hidden = torch.randn(BATCH, SEQ, config.hidden_size, requires_grad=True)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            selective_recompute(selective):
        out = block((hidden, positions))
    del out
    return sum(saved.values())


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_block_bytes_are_eager_and_counted(tmp_path: Path, family: str) -> None:
    config = tiny_config(family)
    model = _config_dir(tmp_path, config)
    eager = {"norm": "layernorm" if family == "gpt2" else "rmsnorm",
             "rotary": family != "gpt2", "mlp_tensors": 5 if family == "gpt2" else 4}
    for sequence_parallel in (False, True):
        block = _block(load_model(model, seq=SEQ, precision="fp32",
                                  sequence_parallel=sequence_parallel))
        for t in (1, 2):
            expected = eager_layer_activation_bytes(
                SEQ, BATCH, 32, 4, q_width=32, kv_width=32 if family == "gpt2" else 16,
                ffn=128 if family == "gpt2" else 64, head_dim=8, t=t,
                sequence_parallel=sequence_parallel, **eager)  # type: ignore[arg-type]
            assert BATCH * block.held(t) == pytest.approx(expected, rel=1e-12)
            # selective drops the core's fp32 log-sum-exp, 4 bytes a token and head
            assert BATCH * (block.held(t) - block.held_selective(t)) == \
                pytest.approx(4 * SEQ * BATCH * 4 / t)
            # full keeps the block's input, fp32 (1/t of it with sequence parallelism)
            assert BATCH * block.kept_input(t) == \
                4 * SEQ * BATCH * 32 / (t if sequence_parallel else 1)
    block = _block(load_model(model, seq=SEQ, precision="fp32"))
    assert BATCH * block.held(1) == _counted(config, selective=False)
    assert BATCH * block.held_selective(1) == _counted(config, selective=True)


def test_korthikanti_for_a_hf_config_fails_the_count(tmp_path: Path) -> None:
    """The planted bug: Megatron's fused-layer pricing (what another engine gets) for this
    engine's HF blocks is off the counted bytes by far more than any tolerance."""
    config = tiny_config("llama")
    fused = _block(load_model(_config_dir(tmp_path, config), seq=SEQ, precision="fp32",
                              hf_eager=False))
    counted = _counted(config, selective=False)
    assert abs(BATCH * fused.held(1) - counted) > 0.25 * counted


def test_full_recompute_keeps_an_fp32_input_under_autocast() -> None:
    """What `hf_eager_profile` prices a fully recomputed block as keeping: its input, which
    is fp32 under bf16 autocast (fp32 weights keep the residual stream fp32)."""
    config = tiny_config("llama")
    hf = layers_from_hf(config)
    block = hf.layers[1].build()
    hidden = torch.randn(BATCH, SEQ, config.hidden_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = block((hidden, torch.arange(SEQ).expand(BATCH, SEQ)))
    assert out.dtype == torch.float32


def test_eager_activations_refuse_a_plan_korthikanti_accepts(tmp_path: Path) -> None:
    """One device whose memory lies between the two pricings of a Llama without
    recomputation: Korthikanti's fits, the eager blocks do not (refused, naming memory);
    with recomputation allowed the eager pick recomputes."""
    config = tiny_config("llama")
    config.num_hidden_layers, config.max_position_embeddings = 4, 2048
    model = _config_dir(tmp_path, config)
    eager = load_model(model, precision="fp32")
    fused = load_model(model, precision="fp32", hf_eager=False)
    one = SearchOptions(tensor_parallel=(1,), pipeline_parallel=(1,), data_parallel=(1,),
                        microbatch_sizes=(8,), zero_stages=(0,), schedules=("1f1b",))
    states = 16 * eager.num_parameters
    need_fused = states + 8 * sum(layer.held(1) for layer in fused.layers)
    need_eager = states + 8 * sum(layer.held(1) for layer in eager.layers)
    assert need_eager > 1.3 * need_fused
    cluster = replace(PRESETS["h100-80g"], nodes=1, devices_per_node=1,
                      device_memory=(need_fused + need_eager) / 2,
                      compute_capability=0)  # a toy device: no CUDA runtime's share
    none = replace(one, recompute_choices=("none",))
    assert plan(fused, cluster, 8, precision="fp32", options=none).best.config.recompute \
        == "none"
    with pytest.raises(PlanError, match=r"does not fit.*GiB"):
        plan(eager, cluster, 8, precision="fp32", options=none)
    picked = plan(eager, cluster, 8, precision="fp32", options=one).best.config
    assert picked.recompute != "none" or picked.recompute_layers
    assert plan(fused, cluster, 8, precision="fp32", options=one).best.config.recompute \
        == "none"


def test_every_family_is_priced_eager_or_named(tmp_path: Path) -> None:
    """A family the eager model was not checked on keeps Korthikanti's pricing and says
    so, with why, in the model's name (printed in the plan's header); so does a sliding
    window shorter than the sequence."""
    assert set(FAMILIES) == set(UNCOVERED) | {"llama", "mistral", "qwen2", "gpt2"}
    name = load_model(_config_dir(tmp_path, tiny_config("phi3")), seq=SEQ).name
    assert "not phi3's eager HF blocks" in name and "fused qkv" in name
    name = load_model(_config_dir(tmp_path, tiny_config("mistral")), seq=SEQ).name
    assert "sliding window of 4 tokens" in name
    windowed = tiny_config("mistral")
    windowed.sliding_window = SEQ  # counted: saves more than the eager model at = seq too
    replicated, split, _ = eager_block_bytes(shape_from_hf_config(windowed.to_dict(), seq=SEQ),
                                             "mistral", sequence_parallel=False)
    assert BATCH * (replicated + split) < _counted(windowed, selective=False)
    assert "sliding window of 16 tokens" in load_model(_config_dir(tmp_path, windowed),
                                                       seq=SEQ).name


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_llama_like_families_are_counted(tmp_path: Path, family: str) -> None:
    """Mistral (its window no shorter than the sequence) and Qwen2 (qkv biases) keep what a
    Llama block keeps: the eager pricing equals their counted bytes too."""
    config = tiny_config(family)
    if family == "mistral":
        config.sliding_window = 4 * SEQ
    block = _block(load_model(_config_dir(tmp_path, config), seq=SEQ, precision="fp32"))
    assert "eager HF" in load_model(str(tmp_path), seq=SEQ).name
    assert BATCH * block.held(1) == _counted(config, selective=False)
    assert BATCH * block.held_selective(1) == _counted(config, selective=True)


def test_plan_cli_prices_eager_blocks_on_pipesched_only(tmp_path: Path) -> None:
    """`pipesched plan` of a HF config: this engine's pricing is the eager blocks', another
    engine's (its own fused layers) Korthikanti's; one `--price` of each, in-process."""
    import contextlib
    import io

    from pipeline.cli import main

    model = _config_dir(tmp_path, tiny_config("llama"))
    held = {}
    for engine in ("pipesched", "deepspeed"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["plan", "--model", model, "--seq", str(SEQ), "--cluster", "a100-80g",
                         "--global-batch", "8", "--precision", "fp32", "--engine", engine,
                         "--price", "pp1,tp1,dp8,b1", "--json"]) == 0
        held[engine] = json.loads(out.getvalue())["memory"]["activations"]
    eager_model = load_model(model, seq=SEQ, precision="fp32")
    fused_model = load_model(model, seq=SEQ, precision="fp32", hf_eager=False)
    eager, fused = _block(eager_model), _block(fused_model)
    eager_head, fused_head = eager_model.layers[-1], fused_model.layers[-1]
    # the two configurations differ by the blocks' and the head's bytes (2 blocks, 1 sample
    # held): the eager head keeps the projection's input, the norm's rsqrt and the int64
    # targets besides
    assert eager_head.held(1) - fused_head.held(1) == 4 * (SEQ * 32 + SEQ) + 8 * SEQ
    assert held["pipesched"] - held["deepspeed"] == pytest.approx(
        2 * (eager.held(1) - fused.held(1)) + eager_head.held(1) - fused_head.held(1))
