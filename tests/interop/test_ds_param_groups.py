"""DeepSpeed's ``initialize(model_parameters=[groups])`` and ``initialize(optimizer=SGD(...))``
train as single-process torch does with the same groups (each group's own weight decay and
learning rate), and DeepSpeed's clipping norm (stage 0's gradients only) is available as
``clip_norm="first_stage"``; the DeepSpeed comparison itself is in
test_deepspeed_groups_same.py (skipped without DeepSpeed)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipeline.interop.deepspeed_compat as deepspeed
from pipeline import LayerSpec
from pipeline.errors import PipelineConfigError
from pipeline.interop.ds_param_groups import param_groups
from pipeline.model.reference import build_reference, reference_forward
from tests.support.equivalence import gathered_weights
from tests.support.rank_harness import run_ranks

STEPS, MICRO, M = 3, 2, 4


def _layers() -> list[Any]:
    return [LayerSpec(nn.Linear, 6, 8), nn.Tanh(), LayerSpec(nn.Linear, 8, 8), nn.Tanh(),
            LayerSpec(nn.Linear, 8, 3)]


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [(torch.randn(MICRO * M, 6, generator=generator) * 3,
             torch.randint(0, 3, (MICRO * M,), generator=generator)) for _ in range(STEPS)]


def _microbatches(batch: tuple[torch.Tensor, torch.Tensor]) -> Iterator[Any]:
    inputs, labels = batch
    return iter([(inputs[k * MICRO:(k + 1) * MICRO], labels[k * MICRO:(k + 1) * MICRO])
                 for k in range(M)])


def split_groups(named: Any) -> list[dict[str, Any]]:
    """The usual split: weights decay 0.5 at the config's lr, biases no decay at lr 1e-3."""
    named = list(named)
    return [{"params": [p for n, p in named if not n.endswith("bias")], "weight_decay": 0.5},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0,
             "lr": 1e-3}]


def _config(**extra: Any) -> dict[str, Any]:
    return {"train_batch_size": MICRO * M, "train_micro_batch_size_per_gpu": MICRO,
            "gradient_clipping": 0, **extra}


ADAMW = {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.1}}


def _torch_run(make_optimizer: Any, clip: Any = None) -> nn.ModuleList:
    """The single-process model after STEPS steps of `make_optimizer(model)`."""
    model = build_reference(_layers())
    optimizer = make_optimizer(model)
    for inputs, labels in _batches():
        optimizer.zero_grad()
        F.cross_entropy(reference_forward(model, inputs), labels).backward()
        if clip is not None:
            clip(model)
        optimizer.step()
    return model


def _assert_same(engine: Any, model: nn.ModuleList) -> None:
    for (layer, name), value in gathered_weights(engine.engine).items():
        expected = dict(model[layer].named_parameters())[name]
        torch.testing.assert_close(value, expected.detach(), rtol=1e-5, atol=1e-6)


def _train(engine: Any) -> None:
    for batch in _batches():
        engine.train_batch(data_iter=_microbatches(batch))


def _check_groups(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    # model_parameters groups: each keeps its own weight decay and learning rate
    module = deepspeed.PipelineModule(layers=_layers(), num_stages=2,
                                      loss_fn=nn.CrossEntropyLoss())
    assert list(module.parameters()), "built at construction, as DeepSpeed's module is"
    engine, _, _, _ = deepspeed.initialize(
        model=module, model_parameters=split_groups(module.named_parameters()),
        config=_config(optimizer=ADAMW))
    _train(engine)
    _assert_same(engine, _torch_run(lambda m: torch.optim.AdamW(
        split_groups(m.named_parameters()), lr=0.05, weight_decay=0.1, eps=1e-8)))
    # a client optimizer over model.parameters(), used as it is
    module = deepspeed.PipelineModule(layers=_layers(), num_stages=2,
                                      loss_fn=nn.CrossEntropyLoss())
    client = torch.optim.SGD(module.parameters(), lr=0.2, momentum=0.9)
    engine, optimizer, _, _ = deepspeed.initialize(model=module, optimizer=client,
                                                   config=_config())
    assert optimizer is client
    _train(engine)
    _assert_same(engine, _torch_run(
        lambda m: torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9)))
    # dynamic_shapes reaches the engine: a short last microbatch trains
    module = deepspeed.PipelineModule(layers=_layers(), num_stages=2,
                                      loss_fn=nn.CrossEntropyLoss())
    engine, _, _, _ = deepspeed.initialize(model=module, config=_config(), dynamic_shapes=True,
                                           optimizer=torch.optim.SGD(module.parameters()))
    inputs, labels = _batches()[0]
    short = iter([(inputs[:2], labels[:2]), (inputs[2:4], labels[2:4]),
                  (inputs[4:6], labels[4:6]), (inputs[6:7], labels[6:7])])
    assert torch.isfinite(engine.train_batch(data_iter=short))
    # ZeRO-1 keeps each group's settings on its shards, as without ZeRO
    zero = _config(optimizer=ADAMW, zero_optimization={"stage": 1})
    module = deepspeed.PipelineModule(layers=_layers(), num_stages=2,
                                      loss_fn=nn.CrossEntropyLoss())
    engine, _, _, _ = deepspeed.initialize(
        model=module, config=zero, model_parameters=split_groups(module.named_parameters()))
    _train(engine)
    _assert_same(engine, _torch_run(lambda m: torch.optim.AdamW(
        split_groups(m.named_parameters()), lr=0.05, weight_decay=0.1, eps=1e-8)))


@pytest.mark.multiprocess
def test_initialize_honours_parameter_groups_and_a_client_optimizer(tmp_path: Path) -> None:
    run_ranks(_check_groups, 2)


def _stage0_clip(boundary: int, max_norm: float) -> Any:
    """DeepSpeed's fp32 pipeline clipping, from its definition: the norm of the gradients
    of the layers before `boundary` (stage 0), every gradient scaled by
    max_norm / (norm + 1e-6) when that is below 1."""
    def clip(model: nn.ModuleList) -> None:
        first = [p.grad for layer in model[:boundary] for p in layer.parameters()]
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in first))
        for p in model.parameters():
            p.grad.mul_(min(1.0, max_norm / (float(norm) + 1e-6)))
    return clip


def _check_clip_norm(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    sgd = {"type": "SGD", "params": {"lr": 0.5}}
    results = {}
    for clip_norm in ("first_stage", "global"):
        module = deepspeed.PipelineModule(layers=_layers(), num_stages=2,
                                          loss_fn=nn.CrossEntropyLoss())
        boundary = module.boundaries[1]
        engine, _, _, _ = deepspeed.initialize(
            model=module, config=_config(optimizer=sgd, gradient_clipping=0.1),
            clip_norm=clip_norm)
        _train(engine)
        results[clip_norm] = engine
    first_stage = _torch_run(lambda m: torch.optim.SGD(m.parameters(), lr=0.5),
                             clip=_stage0_clip(boundary, 0.1))
    whole = _torch_run(lambda m: torch.optim.SGD(m.parameters(), lr=0.5),
                       clip=lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1))
    _assert_same(results["first_stage"], first_stage)
    _assert_same(results["global"], whole)
    with pytest.raises(AssertionError):  # the two norms differ here: the switch matters
        _assert_same(results["global"], first_stage)


@pytest.mark.multiprocess
def test_clip_norm_first_stage_is_deepspeeds_norm_and_global_is_torchs() -> None:
    run_ranks(_check_clip_norm, 2)


def test_clip_norm_first_stage_is_refused_where_deepspeed_counts_every_stage() -> None:
    from pipeline.interop.ds_clipping import check_clip_norm

    check_clip_norm("first_stage", zero_stage=0, precision="fp32")
    with pytest.raises(PipelineConfigError, match="clip_norm='global'"):
        check_clip_norm("first_stage", zero_stage=1, precision="fp32")
    with pytest.raises(PipelineConfigError, match="clip_norm='global'"):
        check_clip_norm("first_stage", zero_stage=0, precision="bf16")
    with pytest.raises(PipelineConfigError, match="'global' or 'first_stage'"):
        check_clip_norm("stage0", zero_stage=0, precision="fp32")  # type: ignore[arg-type]


def test_initialize_refuses_a_keyword_it_would_drop() -> None:
    module = deepspeed.PipelineModule(layers=_layers(), num_stages=2,
                                      loss_fn=nn.CrossEntropyLoss())
    with pytest.raises(PipelineConfigError, match="dynamic_shape= is not an initialize"):
        deepspeed.initialize(model=module, config=_config(), dynamic_shape=True)
    with pytest.raises(PipelineConfigError, match="mpu= is not available"):
        deepspeed.initialize(model=module, config=_config(), mpu=object())


def test_model_parameters_read_as_deepspeed_reads_them() -> None:
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))
    assert param_groups(None) is None
    assert param_groups(iter([a, b])) == [{"params": [a, b]}]
    groups = param_groups([{"params": a, "lr": 0.1}, {"params": (b,)}])
    assert groups == [{"params": [a], "lr": 0.1}, {"params": [b]}]
    with pytest.raises(PipelineConfigError, match="not a mix"):
        param_groups([a, {"params": [b]}])
    with pytest.raises(PipelineConfigError, match="no 'params'"):
        param_groups([{"lr": 0.1}])
