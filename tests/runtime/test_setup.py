"""Setup across ranks: configuration errors caught before any step, LayerSpec built only on
its owner, checkpoints that load under another partition."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from pipeline import LayerSpec, PipelineConfigError, PipelineEngine, PipelineModule, launch
from pipeline.model.reference import reference_step
from tests.support.pipeline_models import MODELS

pytestmark = pytest.mark.multiprocess


def _config_errors_rank() -> list[str]:
    rank = torch.distributed.get_rank()
    messages = []

    def attempt(make: Any) -> None:
        try:
            make()
        except PipelineConfigError as error:
            messages.append(str(error))
        else:
            messages.append("")

    layers = MODELS["mlp"].layers
    # ranks disagree on the number of microbatches
    attempt(lambda: PipelineEngine(PipelineModule(layers(), num_stages=2),
                                   schedule="1f1b", num_microbatches=2 + rank))
    # world size 2 is not a multiple of 3 stages
    attempt(lambda: PipelineEngine(PipelineModule(layers(), num_stages=3), schedule="gpipe",
                                   num_microbatches=2))
    # GPipe runs one chunk per rank
    attempt(lambda: PipelineEngine(PipelineModule(layers(), num_stages=2, chunks=2),
                                   schedule="gpipe", num_microbatches=2))
    # a batch of 10 does not split into 4 microbatches (refused on every rank, no hang)
    engine = PipelineEngine(PipelineModule(layers(), num_stages=2, loss_fn=MODELS["mlp"].loss),
                            schedule="1f1b", num_microbatches=4)
    attempt(lambda: engine.train_batch(*MODELS["mlp"].batch(seed=0, batch=10)))
    # ... and the engine still works afterwards
    engine.train_batch(*MODELS["mlp"].batch(seed=0, batch=8))
    return messages


def test_configuration_errors_are_caught_up_front_on_every_rank() -> None:
    per_rank = launch(_config_errors_rank, 2, timeout=20, join_timeout=90)
    for messages in per_rank:
        disagree, indivisible, chunks, batch = messages
        assert "num_microbatches" in disagree and "rank 1" in disagree
        assert "not divisible by num_stages=3" in indivisible
        assert "'gpipe'" in chunks and "interleaved" in chunks
        assert "refused the batch" in batch or "not divisible by num_microbatches=4" in batch
    assert "batch size 10 is not divisible by num_microbatches=4" in per_rank[0][3]


def test_layer_spec_is_only_built_on_its_owner() -> None:
    built = launch(_count_builds, 2, timeout=20, join_timeout=60)
    assert built == [[0, 1], [2, 3]]


_BUILT: list[int] = []


class _Counted(nn.Linear):
    def __init__(self, index: int) -> None:
        super().__init__(4, 4)
        _BUILT.append(index)


def _count_builds() -> list[int]:
    module = PipelineModule([LayerSpec(_Counted, k) for k in range(4)], num_stages=2,
                            partition_method="uniform")
    PipelineEngine(module, schedule="gpipe", num_microbatches=1)
    return sorted(_BUILT)


def _checkpoint_rank(directory: str) -> float:
    layers, loss = MODELS["mlp"].layers, MODELS["mlp"].loss
    engine = PipelineEngine(PipelineModule(layers(), num_stages=2, loss_fn=loss,
                                           partition_method=[0, 4, 16]),
                            schedule="1f1b", num_microbatches=2,
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5))
    engine.train_batch(*MODELS["mlp"].batch(seed=0, batch=8))
    engine.save_checkpoint(directory)
    saved = {key: p.detach().clone() for key, p in engine.module.named_layer_parameters()}
    gathered: list[Any] = [None, None]
    torch.distributed.all_gather_object(gathered, saved)
    saved = {**gathered[0], **gathered[1]}
    # another partition, fresh (differently seeded) weights, then the checkpoint
    other = PipelineEngine(PipelineModule(layers(), num_stages=2, loss_fn=loss,
                                          partition_method=[0, 12, 16], base_seed=7),
                           schedule="gpipe", num_microbatches=2)
    other.load_checkpoint(directory)
    return max(float((p - saved[key]).abs().max())
               for key, p in other.module.named_layer_parameters())


def test_checkpoints_load_under_another_partition(tmp_path: Any) -> None:
    errors = launch(_checkpoint_rank, 2, str(tmp_path / "ckpt"), timeout=20, join_timeout=60)
    assert errors == [0.0, 0.0]
    # one training step: the checkpoint is ckpt/step_000001/, one file per Linear layer
    assert len(list((tmp_path / "ckpt" / "step_000001").glob("layer_*-model_states.pt"))) == 8


def _data_parallel_rank() -> dict[str, float]:
    # pp = 2 × dp = 2: each replica trains on its half of the batch; the averaged gradients
    # and the reported loss equal one process on the whole batch
    spec = MODELS["transformer"]
    engine = PipelineEngine(PipelineModule(spec.layers(), num_stages=2, loss_fn=spec.loss),
                            schedule="1f1b", num_microbatches=2,
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    inputs, targets = spec.batch(seed=3, batch=8)
    half = engine.position.dp_rank
    loss = engine.train_batch(inputs[half * 4:(half + 1) * 4], targets[half * 4:(half + 1) * 4])
    expected = reference_step(spec.layers(), inputs, targets, loss_fn=spec.loss,
                              optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    grad = max(float((p.grad - expected.grads[key]).abs().max())
               for key, p in engine.module.named_layer_parameters())
    param = max(float((p.detach() - expected.params[key]).abs().max())
                for key, p in engine.module.named_layer_parameters())
    return {"loss": abs(loss - expected.loss), "grad": grad, "param": param}


def test_data_parallel_replicas_average_to_the_full_batch() -> None:
    for errors in launch(_data_parallel_rank, 4, timeout=30, join_timeout=120):
        assert max(errors.values()) < 2e-5, errors
