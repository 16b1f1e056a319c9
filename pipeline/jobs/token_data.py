"""Training batches from a tokenised file on disk: a flat memory-mapped token array, packed
into sequences of seq_len + 1 tokens and sharded over data-parallel replicas.

The file is what nanoGPT's ``prepare.py`` and Megatron's flat ``.bin`` hold: token ids back to
back, one dtype (uint16 or uint32), no header. The dtype is given (``--data-dtype``) or read
from a sidecar JSON beside it (``FILE.json``: ``{"dtype": "uint16"}``).

Legend: n tokens in the file, s the sequence length, B sequences per optimizer step (the
global batch), d data-parallel replicas. Sequence k is tokens [k·s, k·s + s + 1): the inputs
are its first s tokens, the targets its last s (Megatron's GPTDataset and nanoGPT's
``get_batch`` windows), so consecutive sequences share one token and every token but the
first is a target once per epoch. There are N = (n - 1) // s sequences; the data position is
a count of sequences consumed, P. Step t takes sequences P .. P + B - 1 of the epoch order
(wrapping into the next epoch), and replica r of d takes rows r·B/d .. (r + 1)·B/d - 1 of
them: every rank of a replica (its pipeline and tensor-parallel ranks) reads the same rows.
An epoch's order is the identity, or with a seed a permutation drawn from (seed, epoch), so
P alone (saved in a checkpoint) says which batches come next.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["TOKEN_DTYPES", "TokenBatches", "TokenFile", "open_token_file", "sidecar_path"]

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32, "int32": np.int32}
"""The token dtypes a file may hold (uint16 fits vocabularies up to 65,536)."""


def sidecar_path(path: Path) -> Path:
    """The JSON that names a token file's dtype: ``FILE.json`` beside ``FILE``."""
    return path.with_name(path.name + ".json")


@dataclass(frozen=True)
class TokenFile:
    """A token file mapped into memory: pages are read when a batch touches them."""

    path: Path
    tokens: np.ndarray
    """The whole file as a read-only memory map of `dtype` ids."""
    dtype: str


def open_token_file(path: str | Path, dtype: str | None = None) -> TokenFile:
    """Map `path` read-only; `dtype` (one of `TOKEN_DTYPES`) or the sidecar JSON's ``dtype``."""
    path = Path(path)
    if not path.is_file():
        state = "not a regular file" if path.exists() else "no such file"
        raise ValueError(f"--data {path}: {state}; pass a flat token file (uint16 or "
                         "uint32 ids back to back, e.g. nanoGPT's train.bin)")
    sidecar = sidecar_path(path)
    if dtype is None:
        if not sidecar.is_file():
            raise ValueError(f"--data {path}: its dtype is unknown; pass --data-dtype "
                             f"({' or '.join(TOKEN_DTYPES)}) or write {sidecar} holding "
                             '{"dtype": "uint16"}')
        try:
            document = json.loads(sidecar.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"{sidecar}: not readable JSON ({error}); write "
                             '{"dtype": "uint16"} or pass --data-dtype') from None
        dtype = document.get("dtype") if isinstance(document, dict) else None
        where = str(sidecar)
    else:
        where = "--data-dtype"
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"{where}: dtype {dtype!r} is none of {', '.join(TOKEN_DTYPES)}")
    itemsize = np.dtype(TOKEN_DTYPES[dtype]).itemsize
    size = path.stat().st_size
    if size == 0 or size % itemsize:
        raise ValueError(f"--data {path}: {size} bytes is not a whole number of {dtype} "
                         f"tokens ({itemsize} bytes each); is the dtype right?")
    tokens = np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r")
    return TokenFile(path, tokens, dtype)


class TokenBatches:
    """This replica's rows of each step's batch, read from a `TokenFile` (see the module
    docstring for the packing, the order and the data position)."""

    def __init__(self, source: TokenFile, *, seq_len: int, global_batch: int,
                 data_parallel: int, replica: int, vocab_size: int, seed: int | None = None
                 ) -> None:
        if global_batch % data_parallel:
            raise ValueError(f"global batch {global_batch} does not split over "
                             f"{data_parallel} data-parallel replicas")
        self.source = source
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.rows = range(replica * global_batch // data_parallel,
                          (replica + 1) * global_batch // data_parallel)
        self.vocab_size = vocab_size
        self.seed = seed
        self.num_sequences = (len(source.tokens) - 1) // seq_len
        """N: whole windows of seq_len + 1 tokens in the file."""
        if self.num_sequences < global_batch:
            raise ValueError(
                f"--data {source.path}: {len(source.tokens):,} tokens make "
                f"{self.num_sequences} sequences of {seq_len} + 1, fewer than one batch of "
                f"{global_batch}; use more data, a shorter --seq-len or a smaller --batch-size")
        self._order: tuple[int, torch.Tensor] | None = None

    def _sequence_index(self, position: int) -> int:
        """Which sequence of the file comes `position`-th in the epochs' order."""
        epoch, offset = divmod(position, self.num_sequences)
        if self.seed is None:
            return offset
        if self._order is None or self._order[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = (epoch, torch.randperm(self.num_sequences, generator=generator))
        return int(self._order[1][offset])

    def batch(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (B/d, s) int64: this replica's rows of the batch that
        starts at data position `position` (sequences consumed so far)."""
        windows = []
        for row in self.rows:
            start = self._sequence_index(position + row) * self.seq_len
            windows.append(np.asarray(self.source.tokens[start:start + self.seq_len + 1],
                                      dtype=np.int64))
        tokens = torch.from_numpy(np.stack(windows))
        largest = int(tokens.max())
        if largest >= self.vocab_size:
            raise ValueError(f"--data {self.source.path}: token id {largest} is outside the "
                             f"model's vocabulary of {self.vocab_size} (sequences from "
                             f"position {position}); was it tokenised for this model, with "
                             "this dtype?")
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def advance(self, position: int) -> int:
        """The data position after the batch that starts at `position`."""
        return position + self.global_batch
