"""Greedy generation with a pipelined HF Llama (2 ranks, random weights from a tiny config).

    PYTHONPATH=. python examples/hf_generate.py

Each rank builds only its own layers from the config and loads their weights from a
checkpoint directory (written here by `save_pretrained`, as a real one would be). Prompts
of different lengths are left-padded (attention mask 0); each stage keeps its layers' KV
cache, so after the prompt only the new token travels between ranks; a row stops at the EOS
token and is padded after it. Rank 0 checks the tokens against HF's own `generate`.
"""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist

from pipeline import PipelineEngine, PipelineModule, launch
from pipeline.interop.hf_layers import layers_from_hf
from pipeline.interop.hf_weights import load_hf_weights
from pipeline.runtime.generation import greedy_generate
from pipeline.runtime.inference import Inference

__all__: list[str] = []


def _config() -> object:
    import transformers

    return transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=50, max_position_embeddings=32, bos_token_id=0,
        eos_token_id=0)


def _generate(directory: str) -> list[list[int]]:
    import transformers

    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(_config())
    if dist.get_rank() == 0:
        hf_model.save_pretrained(directory)
    dist.barrier()
    hf = layers_from_hf(_config())
    module = PipelineModule(hf.layers, num_stages=dist.get_world_size(), loss_fn=hf.loss_fn)
    load_hf_weights(module, hf, directory)  # each rank reads only its own stages' tensors
    engine = PipelineEngine(module, schedule="1f1b", num_microbatches=2)
    prompt = torch.tensor([[5, 7, 11, 13], [0, 0, 4, 6]])  # the second is 2 tokens long
    mask = (prompt != 0).long()
    eos = 27  # a row stops at its first 27 and is padded with 0 until every row has stopped
    tokens = greedy_generate(Inference(engine), prompt, max_new_tokens=6, attention_mask=mask,
                             eos_token_id=eos, pad_token_id=0, num_microbatches=1)
    if dist.get_rank() == 0:
        expected = hf_model.generate(prompt, max_new_tokens=6, do_sample=False,
                                     attention_mask=mask, eos_token_id=eos, pad_token_id=0)
        same = torch.equal(tokens, expected)
        print(f"pipelined: {tokens.tolist()}\nHF generate: {expected.tolist()}\nsame: {same}")
    return tokens.tolist()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as directory:
        launch(_generate, 2, directory, timeout=300)
