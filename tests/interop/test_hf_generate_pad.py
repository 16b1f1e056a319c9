"""`greedy_generate` fills a finished row with the pad id HF's ``generate`` uses: the one
given, else the generation config's ``pad_token_id``, else the first EOS id."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from pipeline import PipelineEngine, PipelineModule
from pipeline.interop.hf_layers import layers_from_hf
from pipeline.interop.hf_weights import load_hf_weights
from pipeline.runtime.generation import greedy_generate
from pipeline.runtime.inference import Inference
from tests.support.hf_models import tiny_model
from tests.support.rank_harness import run_ranks

NEW_TOKENS, PROMPT_PAD = 6, 0


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    ids = torch.randint(1, 50, (3, 6), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = PROMPT_PAD
    return ids, mask


def _saved_with_generation_pad(directory: Path) -> tuple[int, int, int]:
    """A tiny Llama saved with a generation config whose EOS is a token row 0 generates
    first at new position k (k + 1 < NEW_TOKENS; the other rows go on) and whose pad id is
    another token; (eos, pad, k)."""
    model = tiny_model("llama", seed=7)
    ids, mask = _prompts()
    free = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                          do_sample=False, pad_token_id=PROMPT_PAD, eos_token_id=[])
    new = [int(token) for token in free[0, ids.shape[1]:]]
    at = next(k for k in range(NEW_TOKENS - 1) if new[k] not in new[:k])
    eos = new[at]
    vocab = model.config.vocab_size
    pad = vocab - 1 if vocab - 1 != eos else vocab - 2
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    model.save_pretrained(directory)  # generation_config.json holds both
    return eos, pad, at


def _check_pad(rank: int, world_size: int, saved: str, expected: torch.Tensor,
               eos: int) -> None:
    import transformers

    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(saved)
    hf = layers_from_hf(transformers.AutoConfig.from_pretrained(saved))
    module = PipelineModule(hf.layers, num_stages=world_size, loss_fn=hf.loss_fn)
    load_hf_weights(module, hf, model.state_dict())
    engine = PipelineEngine(module, schedule="1f1b", num_microbatches=1, timeout=60)
    ids, mask = _prompts()
    tokens = greedy_generate(Inference(engine), ids, NEW_TOKENS, attention_mask=mask)
    assert torch.equal(tokens, expected), (tokens, expected)
    given = greedy_generate(Inference(engine), ids, NEW_TOKENS, attention_mask=mask,
                            eos_token_id=eos)  # an EOS given, no pad: still the config's
    assert torch.equal(given, expected), (given, expected)


@pytest.mark.multiprocess
def test_a_finished_row_is_padded_with_the_generation_config_pad_as_hf(tmp_path: Path) -> None:
    # regression: a finished row was filled with its EOS id, HF fills it with pad_token_id
    import transformers

    eos, pad, at = _saved_with_generation_pad(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    ids, mask = _prompts()
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                              do_sample=False)  # HF reads eos and pad from the config
    finished = expected[0, ids.shape[1] + at:].tolist()
    assert finished == [eos] + [pad] * (NEW_TOKENS - at - 1), (finished, eos, pad)
    run_ranks(_check_pad, 2, str(tmp_path), expected, eos, timeout=300)
