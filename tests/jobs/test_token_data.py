"""Token files read lazily: windows of seq_len + 1, data-parallel shards, epochs and the data
position, checked against an oracle written from the definition; refusals name the fix."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.jobs.token_data import TokenBatches, open_token_file


def _write(path: Path, tokens: np.ndarray, dtype: str | None = "uint16") -> Path:
    tokens.astype(dtype or "uint16").tofile(path)
    if dtype is not None:
        (path.parent / (path.name + ".json")).write_text(json.dumps({"dtype": dtype}))
    return path


def _oracle(tokens: np.ndarray, s: int, batch: int, step: int, d: int, r: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """From the definition: sequence k is tokens[k·s : k·s + s + 1]; step t of a file-order
    run takes sequences t·B .. t·B + B - 1 (mod N); replica r its B/d rows in order."""
    n = (len(tokens) - 1) // s
    rows = []
    for j in range(r * batch // d, (r + 1) * batch // d):
        k = (step * batch + j) % n
        rows.append(tokens[k * s:k * s + s + 1].astype(np.int64))
    window = torch.tensor(np.stack(rows))
    return window[:, :-1], window[:, 1:]


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_batches_are_the_defined_windows_over_replicas_and_epochs(tmp_path: Path,
                                                                  dtype: str) -> None:
    tokens = np.arange(103) % 97  # 102 // 8 = 12 sequences: a batch of 8 wraps at step 1
    source = open_token_file(_write(tmp_path / "train.bin", tokens, dtype))
    assert source.dtype == dtype and len(source.tokens) == 103
    for d in (1, 2, 4):
        replicas = [TokenBatches(source, seq_len=8, global_batch=8, data_parallel=d,
                                 replica=r, vocab_size=97) for r in range(d)]
        position = 0
        for step in range(4):
            for r, batches in enumerate(replicas):
                inputs, targets = batches.batch(position)
                expected = _oracle(tokens, 8, 8, step, d, r)
                assert inputs.dtype == torch.int64 and inputs.shape == (8 // d, 8)
                assert torch.equal(inputs, expected[0]) and torch.equal(targets, expected[1])
            position = replicas[0].advance(position)
    # the targets are the inputs moved by one token: every input predicts its next token
    inputs, targets = TokenBatches(source, seq_len=8, global_batch=8, data_parallel=1,
                                   replica=0, vocab_size=97).batch(0)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_a_shuffled_order_is_a_permutation_per_epoch_fixed_by_the_seed(tmp_path: Path) -> None:
    tokens = np.arange(1 + 4 * 12) % 50
    source = open_token_file(_write(tmp_path / "t.bin", tokens))

    def epoch(seed: int, number: int) -> list[int]:
        batches = TokenBatches(source, seq_len=4, global_batch=12, data_parallel=1,
                               replica=0, vocab_size=50, seed=seed)
        inputs, _ = batches.batch(12 * number)
        return [int(row[0]) // 4 for row in inputs]  # row k starts with token 4k

    assert sorted(epoch(7, 0)) == list(range(12))  # each sequence once an epoch
    assert epoch(7, 0) == epoch(7, 0) and epoch(7, 0) != epoch(7, 1)
    assert epoch(7, 0) != epoch(8, 0)
    # a fresh reader at a saved position (a resumed run) reads the same rows
    first = TokenBatches(source, seq_len=4, global_batch=5, data_parallel=1, replica=0,
                         vocab_size=50, seed=3)
    later = TokenBatches(source, seq_len=4, global_batch=5, data_parallel=1, replica=0,
                         vocab_size=50, seed=3)
    first.batch(0)
    assert torch.equal(first.batch(25)[0], later.batch(25)[0])


def test_refusals_name_the_value_and_the_fix(tmp_path: Path) -> None:
    tokens = np.arange(40)
    bare = _write(tmp_path / "bare.bin", tokens, None)
    with pytest.raises(ValueError, match=r"--data-dtype .*bare\.bin\.json"):
        open_token_file(bare)
    assert open_token_file(bare, "uint16").dtype == "uint16"
    with pytest.raises(ValueError, match="no such file"):
        open_token_file(tmp_path / "missing.bin")
    fifo = tmp_path / "fifo.bin"
    os.mkfifo(fifo)  # mapping it would block: refused unopened
    with pytest.raises(ValueError, match="not a regular file"):
        open_token_file(fifo, "uint16")
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00" * 7)
    with pytest.raises(ValueError, match="not a whole number of uint32"):
        open_token_file(odd, "uint32")
    (tmp_path / "bad.bin").write_bytes(b"\x00" * 8)
    (tmp_path / "bad.bin.json").write_text('{"dtype": "float32"}')
    with pytest.raises(ValueError, match="'float32' is none of"):
        open_token_file(tmp_path / "bad.bin")
    source = open_token_file(bare, "uint16")
    with pytest.raises(ValueError, match="fewer than one batch"):
        TokenBatches(source, seq_len=8, global_batch=8, data_parallel=1, replica=0,
                     vocab_size=100)
    with pytest.raises(ValueError, match="token id 36 is outside the model's vocabulary of 30"):
        TokenBatches(source, seq_len=4, global_batch=8, data_parallel=1, replica=0,
                     vocab_size=30).batch(2)
