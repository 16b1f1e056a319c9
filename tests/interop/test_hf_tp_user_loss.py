"""A user's own loss on `tensor_parallel_hf` layers gets whole logits (issue 49 item 9).

Before the fix it received its tp rank's vocabulary slice: a wrong loss (4.0587 against HF's
4.7182) when the labels fell in rank 0's slice, an IndexError otherwise."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from pipeline import PipelineEngine, PipelineModule
from pipeline.interop.hf_layers import causal_lm_loss, causal_lm_targets, layers_from_hf
from pipeline.interop.hf_tensor_parallel import tensor_parallel_hf
from pipeline.interop.hf_weights import load_hf_weights
from pipeline.parallel.tensor.shard_layout import layout_of
from pipeline.runtime.loss_normalization import token_cross_entropy
from pipeline.runtime.whole_vocabulary import (
    VOCAB_PARALLEL_LOSS,
    WholeVocabularyLoss,
    gather_vocabulary,
)
from tests.support.hf_models import VOCAB, tiny_model, token_batch
from tests.support.rank_harness import run_ranks

TOLERANCE = 1e-5


def users_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A loss written for a plain model: (b, s, vocab) logits, HF's labels."""
    assert logits.shape[-1] == VOCAB, f"the loss got logits of width {logits.shape[-1]}"
    return causal_lm_loss(logits, labels)


def _errors(family: str, tied: bool, loss_name: str, directory: str) -> tuple[float, float]:
    """(loss, gradient) relative errors of one pp 1 × tp 2 step against HF's own."""
    hf_model: Any = tiny_model(family, tied=tied, seed=3)
    if dist.get_rank() == 0:
        hf_model.save_pretrained(directory)
    dist.barrier()
    ids, _ = token_batch(4, 8, seed=5)
    labels = causal_lm_targets(ids)
    hf = tensor_parallel_hf(layers_from_hf(hf_model.config))
    loss_fn: Any = users_loss if loss_name == "mean" else token_cross_entropy(shift=True)
    module = PipelineModule(hf.layers, num_stages=1, loss_fn=loss_fn)
    load_hf_weights(module, hf, directory)
    engine = PipelineEngine(module, num_microbatches=2, tensor_parallel=2, timeout=60)
    assert isinstance(engine._interpreter.loss_fn, WholeVocabularyLoss)
    loss = engine.train_batch(ids, labels)
    grads = engine.reduced_gradients()
    expected: torch.Tensor = hf_model(input_ids=ids, labels=labels).loss
    expected.backward()
    reference = dict(hf_model.named_parameters(remove_duplicate=False))
    squared, norm = 0.0, 0.0
    for key, param in module.named_layer_parameters():
        grad = reference[hf.hf_name(*key)].grad
        assert grad is not None, key
        layout = layout_of(param)
        want = grad if layout is None else layout.shard(grad)
        squared += float((grads[key] - want).pow(2).sum())
        norm += float(want.pow(2).sum())
    dist.barrier()
    return abs(loss - expected.item()) / expected.item(), (squared / norm) ** 0.5


def _uneven_slices_gather_in_rank_order() -> None:
    """Parts of widths 3 and 2 (an odd vocabulary's `tensor_split`) against torch.cat."""
    whole = torch.arange(10.0).reshape(2, 5).requires_grad_()
    rank = dist.get_rank()
    mine = whole[:, :3] if rank == 0 else whole[:, 3:]
    world = dist.group.WORLD
    assert world is not None
    gathered = gather_vocabulary(mine, world)
    assert torch.equal(gathered, whole.detach())
    (gathered * torch.arange(5.0)).sum().backward()
    want = torch.arange(5.0).expand(2, 5)
    assert whole.grad is not None
    assert torch.equal(whole.grad, torch.where(torch.arange(5) < 3, want, 0.0) if rank == 0
                       else torch.where(torch.arange(5) >= 3, want, 0.0))


def _user_losses_equal_hf(rank: int, world_size: int, root: str) -> None:
    torch.set_num_threads(1)
    _uneven_slices_gather_in_rank_order()
    for index, (family, tied, loss_name) in enumerate(
            [("llama", False, "mean"), ("gpt2", True, "mean"), ("llama", False, "summed")]):
        loss_error, grad_error = _errors(family, tied, loss_name, f"{root}/{index}")
        assert loss_error < TOLERANCE and grad_error < TOLERANCE, \
            (family, tied, loss_name, loss_error, grad_error)


@pytest.mark.multiprocess
def test_a_users_loss_on_tensor_parallel_hf_layers_equals_hf(tmp_path: Any) -> None:
    run_ranks(_user_losses_equal_hf, 2, str(tmp_path), timeout=300)


def test_the_hf_losses_take_the_slices_and_a_users_does_not() -> None:
    hf = tensor_parallel_hf(layers_from_hf(tiny_model("llama", tied=False).config))
    assert getattr(hf.loss_fn, VOCAB_PARALLEL_LOSS)
    assert getattr(hf.summed_loss, VOCAB_PARALLEL_LOSS)
    assert not getattr(users_loss, VOCAB_PARALLEL_LOSS, False)
    summed = token_cross_entropy()
    wrapped = WholeVocabularyLoss(summed, None)  # type: ignore[arg-type]
    summed.scale = 0.25  # the normalised step sets the module's loss; the wrapper reads it
    assert (wrapped.reduction, wrapped.count, wrapped.scale) == ("sum", summed.count, 0.25)
    with pytest.raises(TypeError, match="must be the logits tensor"):
        wrapped((torch.zeros(1), torch.zeros(1)), torch.zeros(1))
