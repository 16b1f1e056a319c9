"""Greedy generation through the pipeline equals HF's ``generate(do_sample=False)`` on every
covered family: a KV cache kept per stage, left-padded prompts of different lengths, several
microbatches, EOS stopping and padding."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from pipeline import PipelineEngine, PipelineModule
from pipeline.errors import PipelineConfigError
from pipeline.interop.hf_layers import layers_from_hf
from pipeline.interop.hf_modules import HFBlock
from pipeline.interop.hf_modules_tp import SequenceSwitch
from pipeline.interop.hf_tensor_parallel import tensor_parallel_hf
from pipeline.interop.hf_weights import load_hf_weights
from pipeline.runtime.generation import greedy_generate
from pipeline.runtime.inference import Inference
from tests.support.hf_models import FAMILIES, tiny_config, tiny_model
from tests.support.rank_harness import run_ranks

NEW_TOKENS = 6
PAD = 0


def _left_padded_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """4 prompts of 8, 5, 3 and 8 real tokens, left-padded to 8."""
    generator = torch.Generator().manual_seed(11)
    ids = torch.randint(1, 50, (4, 8), generator=generator)
    mask = torch.ones_like(ids)
    for row, length in enumerate((8, 5, 3, 8)):
        mask[row, :8 - length] = 0
        ids[row, :8 - length] = PAD
    return ids, mask


def _hf_generate(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor,
                 eos: list[int] | None) -> torch.Tensor:
    out: torch.Tensor = model.generate(  # type: ignore[operator]
        ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
        pad_token_id=PAD, eos_token_id=eos if eos is not None else [])
    return out


def _check_family(world_size: int, family: str, tp: int = 1, overlap: bool = False,
                  sequence_parallel: bool = False) -> None:
    hf_model = tiny_model(family, seed=7)
    hf_model.generation_config.eos_token_id = None
    hf = layers_from_hf(tiny_config(family))
    if tp > 1:
        hf = tensor_parallel_hf(hf, sequence_parallel=sequence_parallel, overlap=overlap)
    module = PipelineModule(hf.layers, num_stages=world_size // tp, loss_fn=hf.loss_fn,
                            partition_method="uniform")
    load_hf_weights(module, hf, hf_model.state_dict())
    engine = PipelineEngine(module, schedule="1f1b", num_microbatches=2, timeout=60,
                            tensor_parallel=tp)
    inference = Inference(engine)
    ids, mask = _left_padded_prompts()
    free = _hf_generate(hf_model, ids, mask, None)
    new = free[:, ids.shape[1]:]
    # EOS cases: row 0's second token (that row stops early, the others go on, padded
    # where they end), and every row's third token (all rows stop by then: generation ends).
    cases: list[list[int] | None] = [None, [int(new[0, 1])],
                                     sorted({int(t) for t in new[:, 2]})]
    lengths = []
    steps: list[int] = []
    hooks = [block.register_forward_hook(lambda _m, args, _o: steps.append(
        int(args[0][0].shape[1]))) for block in module.modules() if isinstance(block, HFBlock)]
    per_step = 2 * len(hooks)  # forwards of this rank's blocks per step (2 microbatches)
    for eos in cases:
        expected = _hf_generate(hf_model, ids, mask, eos)
        lengths.append(expected.shape[1])
        for use_cache in (True, False):
            steps.clear()
            tokens = greedy_generate(inference, ids, NEW_TOKENS, attention_mask=mask,
                                     eos_token_id=eos if eos is not None else [],
                                     pad_token_id=PAD,
                                     use_cache=use_cache, num_microbatches=2)
            assert torch.equal(tokens, expected), (family, eos, use_cache, tokens, expected)
            # This rank's blocks saw the prompt, then with the cache one token per step,
            # without it the whole sequence again.
            decoded = steps[per_step:]
            assert steps[:per_step] == [ids.shape[1]] * per_step, steps
            assert all((q == 1) if use_cache else (q > ids.shape[1]) for q in decoded), steps
            if eos is None:
                assert len(decoded) == per_step * (NEW_TOKENS - 1), steps
    for hook in hooks:
        hook.remove()
    if sequence_parallel:  # generation ran the layers over the whole sequence, then back
        switched = [m.region for m in module.modules() if isinstance(m, SequenceSwitch)]
        assert switched and all(r.splits_sequence for r in switched), family
    assert lengths[-1] < ids.shape[1] + NEW_TOKENS, (family, lengths)  # stopped early


def _check_generation(rank: int, world_size: int, families: tuple[str, ...],
                      tp: int = 1, overlap: tuple[bool, ...] = (False,),
                      sequence_parallel: bool = False) -> None:
    torch.set_num_threads(1)
    for family in families:
        for overlapped in overlap:
            _check_family(world_size, family, tp, overlapped, sequence_parallel)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_greedy_generation_equals_hf_generate_on_every_family() -> None:
    run_ranks(_check_generation, 2, FAMILIES, timeout=400)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_greedy_generation_at_tp2_equals_hf_generate() -> None:
    # grouped-query attention (kv heads split), soft-capping and a sliding window; also with
    # the tp collectives overlapped (fused q;k;v and gate;up fed through the KV cache)
    run_ranks(_check_generation, 4, ("gemma2",), 2, (False, True), timeout=400)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_greedy_generation_at_tp2_with_sequence_parallelism_equals_hf_generate() -> None:
    # layers split for sequence-parallel training decode over the whole sequence (GPT-2:
    # its positions layer switches too); a prompt of 8 and single new tokens alike
    run_ranks(_check_generation, 4, ("gpt2",), 2, (False,), True, timeout=400)


def _check_refusals(rank: int, world_size: int) -> None:
    layers = [torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50)]
    module = PipelineModule(layers, num_stages=world_size)
    engine = PipelineEngine(module, schedule="1f1b", num_microbatches=1, timeout=30)
    prompt = torch.randint(1, 50, (2, 3))
    with pytest.raises(PipelineConfigError, match="use_cache=False"):
        greedy_generate(Inference(engine), prompt, 2, use_cache=True)
    with pytest.raises(PipelineConfigError, match="attention_mask must be"):
        greedy_generate(Inference(engine), prompt, 2, attention_mask=torch.ones(2, 4))
    # A model without a cache still generates (re-running the sequence), as before.
    tokens = greedy_generate(Inference(engine), prompt, 2)
    expected = prompt
    for _ in range(2):
        logits = layers[1](layers[0](expected))
        expected = torch.cat([expected, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(tokens, expected)


@pytest.mark.multiprocess
def test_generation_refuses_a_cache_the_model_lacks_and_a_bad_mask() -> None:
    run_ranks(_check_refusals, 2)
