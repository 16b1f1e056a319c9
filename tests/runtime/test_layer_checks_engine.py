"""Through the engine: an in-place first layer on a received activation, and tied-as-asked
shared modules, train exactly as the single-process model does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline import LayerSpec, PipelineEngine, PipelineModule
from pipeline.model.reference import build_reference, reference_forward
from tests.support.rank_harness import run_ranks

SCHEDULES = ("1f1b", "gpipe", "zb-h1")


def _in_place_layers() -> list[object]:
    """AlexNet's classifier shape: every Linear followed by ReLU(inplace=True); the cut at 1
    makes stage 1 start with the in-place ReLU (DeepSpeed's example fails here unchanged)."""
    return [LayerSpec(nn.Linear, 6, 8), nn.ReLU(inplace=True), LayerSpec(nn.Linear, 8, 8),
            nn.ReLU(inplace=True), LayerSpec(nn.Linear, 8, 3)]


def _tied_layers() -> list[nn.Module]:
    torch.manual_seed(3)
    embed = nn.Embedding(10, 6)
    head = nn.Linear(6, 10, bias=False)
    head.weight = embed.weight  # as a HF model with tie_word_embeddings
    return [embed, nn.Linear(6, 6), nn.Tanh(), head]


def _factory_tied_layers() -> list[object]:
    """`LayerSpec(lambda: shared)` at two positions, on two stages (the tie was lost)."""
    torch.manual_seed(4)
    shared = nn.Linear(6, 6)
    spec = LayerSpec(lambda: shared)
    return [spec, nn.Tanh(), spec, nn.Tanh(), LayerSpec(nn.Linear, 6, 3)]


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _check(rank: int, world_size: int) -> None:
    for schedule in SCHEDULES:
        cases = (("in-place", _in_place_layers(), [0, 1, 5], F.cross_entropy,
                  torch.randn(8, 6), torch.randint(0, 3, (8,))),
                 ("tied", _tied_layers(), [0, 2, 4], _lm_loss,
                  torch.randint(0, 10, (8, 5)), torch.randint(0, 10, (8, 5))),
                 ("factory-tied", _factory_tied_layers(), [0, 2, 5], F.cross_entropy,
                  torch.randn(8, 6), torch.randint(0, 3, (8,))))
        for label, layers, cuts, loss_fn, inputs, targets in cases:
            reference = build_reference(layers)
            module = PipelineModule(layers, num_stages=2, partition_method=cuts,
                                    loss_fn=loss_fn, tie_shared=label != "in-place")
            engine = PipelineEngine(module, schedule=schedule, num_microbatches=4, timeout=30)
            loss = engine.train_batch(inputs, targets)
            expected = loss_fn(reference_forward(reference, inputs), targets)
            expected.backward()
            assert abs(loss - float(expected)) < 1e-5, (schedule, label, loss, float(expected))
            for (index, name), param in module.named_layer_parameters():
                ref_layer = reference[index]
                ref_name = name.split(".", 3)[-1] if name.startswith("module.parts.") else name
                ref = dict(ref_layer.named_parameters(remove_duplicate=False))[ref_name]
                assert param.grad is not None, (schedule, label, index, name)
                # tied: each stage's copy holds the gradient summed over both uses
                torch.testing.assert_close(param.grad, ref.grad, msg=f"{schedule} {name}")


@pytest.mark.multiprocess
def test_in_place_first_layer_and_tied_shared_modules_match_the_reference() -> None:
    run_ranks(_check, 2)
