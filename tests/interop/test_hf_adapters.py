"""HF adapters: every covered family equals the HF model's own loss and gradients, through
every registered training schedule; weights load from a local safetensors checkpoint on the
owning rank only and export back to a HF state dict."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

from pipeline import PipelineEngine, PipelineModule
from pipeline.errors import PipelineConfigError
from pipeline.interop.hf_layers import causal_lm_targets, layers_from_hf
from pipeline.interop.hf_weights import (
    load_hf_weights,
    read_hf_tensors,
)
from pipeline.model.reference import reference_forward
from pipeline.runtime.generation import greedy_generate
from pipeline.runtime.inference import Inference
from pipeline.runtime.loss_normalization import normalized_train_batch
from schedules import SCHEDULES
from tests.support.hf_equivalence import step_differences
from tests.support.hf_models import FAMILIES, tiny_config, tiny_model, token_batch
from tests.support.rank_harness import run_ranks

# a skip without importing transformers (a second of collection); the tests import it
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="needs transformers")

TRAINING_SCHEDULES = [name for name in SCHEDULES if name != "forward-only"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tied", [True, False])
def test_single_process_layers_equal_the_hf_model(family: str, tied: bool) -> None:
    if family == "gpt2" and not tied:
        pytest.skip("GPT-2 always ties its lm_head")
    model = tiny_model(family, tied=tied)
    ids, mask = token_batch(4, 8, padded=True)
    labels = causal_lm_targets(ids, mask)
    expected = model(input_ids=ids, attention_mask=mask, labels=labels)
    for source in ("config", "model"):
        hf = layers_from_hf(tiny_config(family, tied=tied) if source == "config" else model)
        module = PipelineModule(hf.layers, num_stages=2, loss_fn=hf.loss_fn)
        if source == "config":
            load_hf_weights(module, hf, model.state_dict())
        module.materialize([0, 1])
        logits = reference_forward(torch.nn.ModuleList(
            module.stage(s) for s in range(2)), (ids, mask))
        torch.testing.assert_close(logits, expected.logits)
        torch.testing.assert_close(hf.loss_fn(logits, labels), expected.loss)
        assert len(module.tied_keys) == (2 if tied else 0)


def test_unsupported_model_type_names_the_covered_ones() -> None:
    import transformers

    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=4, intermediate_size=64)
    with pytest.raises(PipelineConfigError, match=r"gpt2, llama, mistral, qwen2.*by hand"):
        layers_from_hf(config)


def test_an_unmapped_mixture_of_experts_family_names_the_covered_ones() -> None:
    import transformers

    config = transformers.PhimoeConfig(hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=50,
                                       num_local_experts=4)
    with pytest.raises(PipelineConfigError, match=r"mixtral, qwen2_moe, qwen3_moe, olmoe, "
                                                  r"deepseek_v2, deepseek_v3, not 'phimoe' "
                                                  r"\(4 experts\): its router is SparseMixer"):
        layers_from_hf(config)


def test_image_text_gemma3_points_to_its_text_config() -> None:
    import transformers

    with pytest.raises(PipelineConfigError, match="text_config"):
        layers_from_hf(transformers.Gemma3Config())


def test_final_logit_softcapping_is_applied() -> None:
    """Gemma 2's logits are capped at 30: without the cap the tiny model's logits (scaled
    up here past it) would differ from HF's."""
    model = tiny_model("gemma2")
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(40.0)
    ids, _ = token_batch(2, 8)
    expected = model(input_ids=ids).logits
    assert float(expected.detach().abs().max()) < 30.0
    hf = layers_from_hf(model)
    module = PipelineModule(hf.layers, num_stages=1, loss_fn=hf.loss_fn)
    module.materialize([0])
    torch.testing.assert_close(reference_forward(torch.nn.ModuleList([module.stage(0)]), ids),
                               expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_pass_no_argument_transformers_deprecates(family: str) -> None:
    """`past_key_values=` to HF's mask functions warns (removed in transformers 5.40): the
    training forward and a decoding step (prompt, then one cached token) warn nothing."""
    hf = layers_from_hf(tiny_model(family))
    module = PipelineModule(hf.layers, num_stages=1, loss_fn=hf.loss_fn)
    module.materialize([0])
    stage = torch.nn.ModuleList([module.stage(0)])
    ids, mask = token_batch(2, 8, padded=True)
    positions = torch.arange(8).expand(2, 8)
    rows = torch.arange(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reference_forward(stage, (ids, mask))
        reference_forward(stage, (ids, mask, positions, rows))
        step = reference_forward(stage, (ids[:, :1], torch.cat([mask, mask[:, :1]], 1),
                                         positions[:, :1] + 8, rows))
    assert step.shape[:2] == (2, 1)


def test_checkpoint_directory_loads_only_the_requested_tensors(tmp_path: Path) -> None:
    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    tensors = read_hf_tensors(tmp_path, ["model.norm.weight"])
    assert list(tensors) == ["model.norm.weight"]
    torch.testing.assert_close(tensors["model.norm.weight"], model.model.norm.weight.detach())
    with pytest.raises(PipelineConfigError, match="lacks"):
        read_hf_tensors(tmp_path, ["model.layers.9.mlp.up_proj.weight"])
    with pytest.raises(PipelineConfigError, match="save_pretrained"):
        read_hf_tensors(tmp_path / "missing", ["model.norm.weight"])


def _grads_match(engine: PipelineEngine, hf_model: torch.nn.Module,
                 hf_names: dict[tuple[int, str], str], label: str) -> None:
    reference = dict(hf_model.named_parameters(remove_duplicate=False))
    for key, param in engine.module.named_layer_parameters():
        expected = reference[hf_names[key]].grad
        assert param.grad is not None and expected is not None, (label, key)
        torch.testing.assert_close(param.grad, expected, atol=2e-5, rtol=1e-4,
                                   msg=f"{label}: {hf_names[key]}")


def _check_schedules(rank: int, world_size: int, plan: dict[str, list[str]]) -> None:
    for family, schedules in plan.items():
        _check_family(world_size, family, schedules)
    _check_padded(world_size)
    _check_generate(world_size)


def _check_generate(world_size: int) -> None:
    """Greedy tokens from the pipeline (eval with its own m, logits on every rank) are HF's."""
    hf_model = tiny_model("llama", seed=5)
    hf = layers_from_hf(tiny_config("llama"))
    module = PipelineModule(hf.layers, num_stages=world_size, chunks=2, loss_fn=hf.loss_fn)
    load_hf_weights(module, hf, hf_model.state_dict())
    engine = PipelineEngine(module, schedule="zb-v", num_microbatches=4, timeout=30)
    prompt, _ = token_batch(2, 4, seed=6)
    tokens = greedy_generate(Inference(engine), prompt, max_new_tokens=5, num_microbatches=1)
    expected = hf_model.generate(prompt, max_new_tokens=5, do_sample=False,
                                 attention_mask=torch.ones_like(prompt), pad_token_id=0)
    assert torch.equal(tokens, expected), (tokens, expected)


def _check_padded(world_size: int) -> None:
    """Padded rows: HF's loss is the mean over the batch's real tokens; the pipeline's
    token-weighted loss equals it (the mean of microbatch means would not)."""
    hf_model = tiny_model("llama")
    ids, mask = token_batch(8, 8, seed=4, padded=True)
    labels = causal_lm_targets(ids, mask)
    expected = hf_model(input_ids=ids, attention_mask=mask, labels=labels).loss
    expected.backward()
    for name in ("1f1b", "zb-h1"):
        hf = layers_from_hf(tiny_config("llama"))
        module = PipelineModule(hf.layers, num_stages=world_size, loss_fn=hf.summed_loss)
        load_hf_weights(module, hf, hf_model.state_dict())
        engine = PipelineEngine(module, schedule=name, num_microbatches=4, timeout=30)
        loss = normalized_train_batch(engine, (ids, mask), labels)
        assert abs(loss - float(expected)) < 1e-5, (name, loss, float(expected))
        names = {key: hf.hf_name(*key) for key, _ in module.named_layer_parameters()}
        _grads_match(engine, hf_model, names, f"padded llama {name}")


def _check_family(world_size: int, family: str, schedules: list[str]) -> None:
    hf_model = tiny_model(family)
    ids, _ = token_batch(8, 8, seed=1)
    labels = causal_lm_targets(ids)
    hf_model(input_ids=ids, labels=labels).loss.backward()
    expected = float(hf_model(input_ids=ids, labels=labels).loss)
    for name in schedules:
        hf = layers_from_hf(tiny_config(family))
        chunks = SCHEDULES[name].default_chunks
        module = PipelineModule(hf.layers, num_stages=world_size, chunks=chunks,
                                loss_fn=hf.loss_fn, partition_method="uniform")
        load_hf_weights(module, hf, hf_model.state_dict())
        engine = PipelineEngine(module, schedule=name, num_microbatches=4, timeout=30)
        loss = engine.train_batch(ids, labels)
        assert abs(loss - expected) < 1e-5, (family, name, loss, expected)
        names = {key: hf.hf_name(*key) for key, _ in module.named_layer_parameters()}
        _grads_match(engine, hf_model, names, f"{family} {name}")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_family_and_schedule_equals_the_hf_model() -> None:
    """GPT-2 and Llama through every registered training schedule; Mistral and Qwen2 (the
    Llama shape with their own classes) through 1F1B and ZB-H1; a padded batch with the
    token-weighted loss; greedy generation against HF's generate. One launch: importing
    transformers in each rank is most of the time."""
    run_ranks(_check_schedules, 2, {"gpt2": TRAINING_SCHEDULES, "llama": TRAINING_SCHEDULES,
                                    **{family: ["zb-h1"] for family in FAMILIES[2:]}},
              timeout=300)


@pytest.mark.multiprocess
def test_llama_and_gpt2_through_two_schedules_equal_the_hf_model() -> None:
    """The fast tier's HF case: Llama through 1F1B and ZB-V, GPT-2 (tied) through ZB-H1, the
    padded batch and greedy generation, in one launch (the sweep above is the full tier's)."""
    run_ranks(_check_schedules, 2, {"llama": ["1f1b", "zb-v"], "gpt2": ["zb-h1"]}, timeout=300)


def _check_steps(rank: int, world_size: int) -> None:
    for family in FAMILIES:
        for tied in (True, False) if family != "gpt2" else (True,):
            found = step_differences(family, tied=tied)
            limits = {"loss": 1e-5, "grad": 2e-5, "param": 2e-6, "logits": 2e-5}
            bad = {k: v for k, v in found.items() if not v <= limits[k]}
            assert not bad, (family, tied, bad)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_family_trains_one_step_and_exports_as_hf() -> None:
    """Each family, tied and untied, its weights read per rank from a saved checkpoint:
    loss, every gradient, the weights after one SGD step and the logits of the exported
    checkpoint reloaded by HF equal HF's own step."""
    run_ranks(_check_steps, 2, timeout=300)
