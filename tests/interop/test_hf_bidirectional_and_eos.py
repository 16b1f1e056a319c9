"""Gemma 3 text with ``use_bidirectional_attention=True`` equals HF's model (its masks are
not causal), and `greedy_generate` without `eos_token_id` stops on the checkpoint's
generation-config EOS, as HF's ``generate`` does."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from pipeline import PipelineEngine, PipelineModule
from pipeline.interop.hf_layers import causal_lm_targets, layers_from_hf
from pipeline.interop.hf_weights import load_hf_weights
from pipeline.model.reference import reference_forward
from pipeline.runtime.generation import greedy_generate
from pipeline.runtime.inference import Inference
from tests.support.hf_models import FAMILIES, tiny_config, tiny_model, token_batch
from tests.support.rank_harness import run_ranks

# a skip without importing transformers (a second of collection); the tests import it
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="needs transformers")

NEW_TOKENS, PAD = 6, 0


def _bidirectional_gemma3(seed: int = 0) -> torch.nn.Module:
    import transformers

    config = tiny_config("gemma3_text")
    config.use_bidirectional_attention = True
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("padded", [False, True])
def test_bidirectional_gemma3_equals_the_hf_model(padded: bool) -> None:
    model = _bidirectional_gemma3()
    ids, mask = token_batch(4, 8, padded=padded)
    labels = causal_lm_targets(ids, mask)
    expected = model(input_ids=ids, attention_mask=mask, labels=labels)
    expected.loss.backward()
    hf = layers_from_hf(model.config)
    module = PipelineModule(hf.layers, num_stages=2, loss_fn=hf.loss_fn)
    load_hf_weights(module, hf, model.state_dict())
    module.materialize([0, 1])
    stages = torch.nn.ModuleList(module.stage(s) for s in range(2))
    logits = reference_forward(stages, (ids, mask))
    torch.testing.assert_close(logits, expected.logits)
    hf.loss_fn(logits, labels).backward()
    hf_params = dict(model.named_parameters())
    for (layer, name), param in module.named_layer_parameters():
        torch.testing.assert_close(param.grad, hf_params[hf.hf_name(layer, name)].grad,
                                   rtol=1e-5, atol=1e-6)
    # the flag matters here: the causal model's logits differ
    causal = tiny_model("gemma3_text")
    causal.load_state_dict(model.state_dict())
    assert not torch.allclose(causal(input_ids=ids, attention_mask=mask).logits,
                              expected.logits, atol=1e-3)


def test_bidirectional_attention_elsewhere_is_refused() -> None:
    from pipeline.errors import PipelineConfigError

    config = tiny_config("llama")
    config.use_bidirectional_attention = True
    with pytest.raises(PipelineConfigError, match="gemma3_text"):
        layers_from_hf(config)


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    ids = torch.randint(1, 50, (3, 6), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = PAD
    return ids, mask


def _with_generation_eos(family: str) -> tuple[torch.nn.Module, int, torch.Tensor]:
    """A tiny model whose generation config's EOS is a token it generates (row 0's second),
    that EOS, and HF's tokens from ``generate`` given no EOS (it reads the generation
    config)."""
    model = tiny_model(family, seed=7)
    ids, mask = _prompts()
    free = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                          do_sample=False, pad_token_id=PAD, eos_token_id=[])
    eos = int(free[0, ids.shape[1] + 1])
    model.generation_config.eos_token_id = eos
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                              do_sample=False, pad_token_id=PAD)
    assert not torch.equal(expected, free), family  # the EOS changes HF's tokens here
    return model, eos, expected


def _check_generation_eos(rank: int, world_size: int, saved: str,
                          expected_by_family: dict[str, tuple[int, torch.Tensor]]) -> None:
    import transformers

    torch.set_num_threads(1)
    for family, (eos, expected) in expected_by_family.items():
        model = tiny_model(family, seed=7)  # the launcher's model, rebuilt (same seed)
        model.generation_config.eos_token_id = eos
        hf = layers_from_hf(model)  # the model's own generation config
        engine = PipelineEngine(PipelineModule(hf.layers, num_stages=world_size,
                                               loss_fn=hf.loss_fn, partition_method="uniform"),
                                schedule="1f1b", num_microbatches=1, timeout=60)
        ids, mask = _prompts()
        tokens = greedy_generate(Inference(engine), ids, NEW_TOKENS, attention_mask=mask,
                                 pad_token_id=PAD)
        assert torch.equal(tokens, expected), (family, tokens, expected)
    # from a checkpoint directory: its generation_config.json, as from_pretrained reads it
    model = transformers.AutoModelForCausalLM.from_pretrained(saved)
    ids, mask = _prompts()
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                              do_sample=False, pad_token_id=PAD)
    hf = layers_from_hf(transformers.AutoConfig.from_pretrained(saved))
    module = PipelineModule(hf.layers, num_stages=world_size, loss_fn=hf.loss_fn)
    load_hf_weights(module, hf, model.state_dict())
    engine = PipelineEngine(module, schedule="1f1b", num_microbatches=1, timeout=60)
    tokens = greedy_generate(Inference(engine), ids, NEW_TOKENS, attention_mask=mask,
                             pad_token_id=PAD)
    assert torch.equal(tokens, expected), (tokens, expected)


@pytest.mark.multiprocess
def test_greedy_generate_stops_on_the_generation_config_eos_as_hf(tmp_path: Path) -> None:
    # every family layers_from_hf supports; HF's tokens computed here, once, not per rank
    expected = {}
    for family in FAMILIES:
        model, eos, tokens = _with_generation_eos(family)
        expected[family] = (eos, tokens)
    model, _, _ = _with_generation_eos("llama")
    model.save_pretrained(tmp_path)  # its generation_config.json holds the EOS
    assert model.config.eos_token_id != model.generation_config.eos_token_id
    run_ranks(_check_generation_eos, 2, str(tmp_path), expected, timeout=300)
