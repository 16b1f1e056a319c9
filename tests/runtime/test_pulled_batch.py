"""`train_batch(data_iter=...)` pulls one microbatch at a time, as the step loads it (DeepSpeed's
``LoadMicroBatch``): it trains exactly as the full batch does, and the step's whole batch is
never alive at once, counted in bytes of the microbatches the iterator made."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from pipeline import LayerSpec, PipelineConfigError, PipelineEngine, PipelineModule, launch
from pipeline.errors import RankFailedError
from pipeline.runtime.pulled_batch import PulledMicrobatches
from tests.support.equivalence import gathered_weights

P, M, ROWS, WIDTH = 2, 6, 4, 8
"""Stages (= ranks), microbatches, rows per microbatch, width."""


def _pairs(m: int, rows: int = ROWS, seed: int = 0) -> Iterator[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(m):
        yield (torch.randn(rows, WIDTH, generator=generator),
               torch.randn(rows, WIDTH, generator=generator))


class _Counting:
    """An iterator of fresh microbatches that records, at each pull, the bytes of every
    microbatch tensor it made that is still alive (weak references to their storages)."""

    def __init__(self, pairs: Iterator[tuple[torch.Tensor, ...]]) -> None:
        self.pairs = pairs
        self.made: list[tuple[weakref.ref[Any], int]] = []
        self.pulls = 0
        self.peak = 0
        """Largest live bytes of the microbatches made, over the pulls (live bytes only
        grow at a pull, so this is their peak)."""

    def __iter__(self) -> _Counting:
        return self

    def __next__(self) -> tuple[torch.Tensor, ...]:
        pair = next(self.pairs)
        self.pulls += 1
        for tensor in pair:
            storage = tensor.untyped_storage()
            self.made.append((weakref.ref(storage), storage.nbytes()))
        self.peak = max(self.peak, sum(size for ref, size in self.made if ref() is not None))
        return pair


# -- the pulled pairs, one process ------------------------------------------------------------


def test_pairs_are_pulled_when_first_read_and_handed_over_once() -> None:
    counting = _Counting(_pairs(4))
    pulled = PulledMicrobatches(counting, 4, keep_inputs=True, keep_targets=False,
                                varying=False)
    assert counting.pulls == 1  # pair 0, for the step's vote
    first = pulled.inputs[0]
    assert counting.pulls == 1 and first.shape == (ROWS, WIDTH)
    pulled.inputs[2]
    assert counting.pulls == 3
    with pytest.raises(RuntimeError, match="read twice"):
        pulled.inputs[2]
    with pytest.raises(RuntimeError, match="does not keep"):
        pulled.targets[3]  # pulls pair 3, whose targets this rank drops (not the last stage)
    with pytest.raises(IndexError):
        pulled.inputs[4]
    del first
    # dropped halves and handed-over microbatches are not held: pairs 1 and 3's inputs are
    assert sum(size for ref, size in counting.made if ref() is not None) == 2 * ROWS * WIDTH * 4


def test_a_bad_later_pair_is_refused_when_it_is_pulled() -> None:
    x = torch.zeros(ROWS, WIDTH)
    cases: list[tuple[list[Any], type[Exception], str]] = [
        ([(x, x)], PipelineConfigError, "ran out after 1 of num_microbatches=2"),
        ([(x, x), x], TypeError, "pairs, got Tensor as microbatch 1"),
        ([(x, x), (torch.zeros(ROWS + 1, WIDTH), torch.zeros(ROWS + 1, WIDTH))],
         PipelineConfigError, r"microbatch 1 .* \[5, 8\] float32, microbatch 0 \[4, 8\]"
                              r".*dynamic_shapes=True"),
        ([(x, x), (x, torch.zeros(ROWS + 1))], PipelineConfigError,
         "4 input samples but 5 target samples"),
        ([("x", x)], TypeError, "inputs of microbatch 0 must be a tensor"),
    ]
    for items, error, message in cases:
        with pytest.raises(error, match=message):
            pulled = PulledMicrobatches(iter(items), 2, keep_inputs=True, keep_targets=True,
                                        varying=False)
            pulled.targets[1]
    # with dynamic shapes (a header with every message) the layout may change
    bigger = torch.zeros(ROWS + 1, WIDTH)
    pulled = PulledMicrobatches(iter([(x, x), (bigger, bigger)]), 2, keep_inputs=True,
                                keep_targets=True, varying=True)
    assert pulled.inputs[1] is bigger


# -- the engine, two ranks ---------------------------------------------------------------------


def _module() -> PipelineModule:
    layers: list[Any] = []
    for _ in range(P):
        layers += [LayerSpec(nn.Linear, WIDTH, WIDTH), nn.GELU()]
    return PipelineModule(layers, num_stages=P, loss_fn=nn.functional.mse_loss)


def _engine() -> PipelineEngine:
    return PipelineEngine(_module(), schedule="1f1b", num_microbatches=M,
                          optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))


def _rank() -> dict[str, Any]:
    torch.set_num_threads(1)
    full, pulled = _engine(), _engine()
    outcome: dict[str, Any] = {"losses": [], "peaks": [], "pulls": []}
    for step in range(2):
        pairs = list(_pairs(M, seed=step))
        x = torch.cat([pair[0] for pair in pairs])
        y = torch.cat([pair[1] for pair in pairs])
        counting = _Counting(_pairs(M, seed=step))
        outcome["losses"].append((full.train_batch(x, y),
                                  pulled.train_batch(data_iter=counting)))
        outcome["peaks"].append(counting.peak)
        outcome["pulls"].append(counting.pulls)
    one, two = gathered_weights(full), gathered_weights(pulled)
    outcome["weights_equal"] = all(torch.equal(one[key], two[key]) for key in one)
    # a bad first pair is refused by every rank before anything runs; the engine goes on
    bad = iter([("not a tensor", torch.zeros(ROWS, WIDTH))] * M)
    try:
        pulled.train_batch(data_iter=bad)
        outcome["refused"] = None
    except (TypeError, PipelineConfigError) as error:
        outcome["refused"] = (type(error).__name__, str(error))
    outcome["after"] = pulled.train_batch(data_iter=_pairs(M, seed=5))
    return outcome


@pytest.mark.multiprocess
def test_pulled_microbatches_train_as_the_full_batch_and_never_hold_it() -> None:
    pair_bytes = 2 * ROWS * WIDTH * 4
    for rank, outcome in enumerate(launch(_rank, P, timeout=60, join_timeout=180)):
        for full, pulled in outcome["losses"]:
            assert full == pulled, f"rank {rank}: loss {pulled} from data_iter, {full} split"
        assert outcome["weights_equal"], f"rank {rank}: weights differ after two steps"
        assert outcome["pulls"] == [M, M]
        # Oracle, from 1F1B's definition: rank 0 loads microbatch k while k - 1's forward is
        # still waiting for its backward (its input saved by the first Linear): two pairs'
        # worth at most; the last stage frees each target in its backward before the next
        # load: one pair. Holding the step's batch would be M pairs.
        allowed = pair_bytes * (P if rank == 0 else 1)
        assert all(peak <= allowed for peak in outcome["peaks"]), (rank, outcome["peaks"])
        name, message = outcome["refused"]  # both ranks pull pair 0 and check it
        assert name == "TypeError" and "inputs of microbatch 0" in message, outcome["refused"]
        assert outcome["after"] > 0


def _short_iterator_rank() -> None:
    torch.set_num_threads(1)
    engine = _engine()
    engine.train_batch(data_iter=_pairs(M))
    # rank 0 (first stage) runs out at microbatch 3, mid-step: its peer must not hang
    engine.train_batch(data_iter=_pairs(3 if torch.distributed.get_rank() == 0 else M))


@pytest.mark.multiprocess
def test_an_iterator_running_out_mid_step_stops_every_rank_naming_it() -> None:
    with pytest.raises(RankFailedError, match="ran out after 3 of num_microbatches=6") as info:
        launch(_short_iterator_rank, P, timeout=30, join_timeout=120, quiet=True)
    assert info.value.rank == 0 and info.value.instruction == "0LOAD3"
