"""A tiny HF Llama directory, a token file and the single-process HF losses on its windows,
for `pipesched run`'s tests (test helper)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

__all__ = ["BATCH", "LR", "SEQ", "VOCAB", "hf_losses", "metrics", "model_dir", "token_file"]

VOCAB, SEQ, BATCH, LR = 100, 16, 4, 3e-4


def model_dir(root: Path) -> Path:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=VOCAB,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / "model")
    return root / "model"


def token_file(root: Path) -> Path:
    path = root / "train.bin"
    np.random.default_rng(0).integers(0, VOCAB, 2000).astype(np.uint16).tofile(path)
    (root / "train.bin.json").write_text(json.dumps({"dtype": "uint16"}))
    return path


def metrics(directory: Path) -> dict[int, dict[str, float]]:
    lines = (directory / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record for record in map(json.loads, lines)}


def hf_losses(model: Path, data: Path, steps: int, batch: int = BATCH) -> list[float]:
    """Single-process HF: the same windows (file order), AdamW, mean token cross entropy."""
    import transformers

    from pipeline.jobs.token_data import TokenBatches, open_token_file

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model))
    optimizer = torch.optim.AdamW(hf.parameters(), lr=LR)
    batches = TokenBatches(open_token_file(data), seq_len=SEQ, global_batch=batch,
                           data_parallel=1, replica=0, vocab_size=VOCAB)
    losses = []
    for step in range(steps):
        inputs, targets = batches.batch(step * batch)
        logits = hf(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses
