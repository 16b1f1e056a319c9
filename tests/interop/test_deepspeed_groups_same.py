"""Parameter groups, a client optimizer and DeepSpeed's clipping norm train the same under
DeepSpeed 0.19.8 and under our port: the loss of every step equal (skipped without
DeepSpeed; the comparison with single-process torch is test_ds_param_groups.py).

Both engines run in the same two gloo processes (DS_ACCELERATOR=cpu) from the same
microbatches, on the same small model built from one seed (``"torch_adam": true``: DeepSpeed
steps torch's AdamW, as we do)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.interop.test_ds_param_groups import _batches, _config, _microbatches, split_groups

ROOT = Path(__file__).resolve().parents[2]
deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")

ADAMW = {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.1, "torch_adam": True}}
CASES: dict[str, dict[str, Any]] = {
    "groups": {"config": _config(optimizer=ADAMW), "groups": True},
    "client SGD": {"config": _config(), "client": True},
    "clip first_stage": {"config": _config(optimizer={"type": "SGD", "params": {"lr": 0.5}},
                                           gradient_clipping=0.1),
                         "clip_norm": "first_stage"},
}


def _modules() -> list[nn.Module]:
    torch.manual_seed(11)
    return [nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)]


def _losses(engine: Any) -> list[float]:
    return [float(engine.train_batch(data_iter=_microbatches(batch))) for batch in _batches()]


def _run(initialize: Any, module_class: Any, case: dict[str, Any], **options: Any
         ) -> list[float]:
    module = module_class(layers=_modules(), num_stages=2, loss_fn=nn.CrossEntropyLoss(),
                          partition_method="parameters")
    kwargs: dict[str, Any] = {}
    if case.get("groups"):
        kwargs["model_parameters"] = split_groups(module.named_parameters())
    if case.get("client"):
        kwargs["optimizer"] = torch.optim.SGD(module.parameters(), lr=0.2, momentum=0.9)
    engine, _, _, _ = initialize(model=module, config=case["config"], **kwargs, **options)
    return _losses(engine)


def _both() -> dict[str, dict[str, list[float]]]:
    import deepspeed as ds
    from deepspeed.pipe import PipelineModule as DSPipelineModule

    import pipeline.interop.deepspeed_compat as ours

    torch.set_num_threads(1)
    ds.init_distributed(dist_backend="gloo")
    results = {}
    for name, case in CASES.items():
        options = {"clip_norm": case["clip_norm"]} if "clip_norm" in case else {}
        results[name] = {"ours": _run(ours.initialize, ours.PipelineModule, case, **options),
                         "DeepSpeed": _run(ds.initialize, DSPipelineModule, case)}
    return results


@pytest.mark.multiprocess
@pytest.mark.slow
def test_groups_client_optimizer_and_clip_norm_equal_deepspeed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline import launch

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]))
    results = launch(_both, 2, timeout=600.0, join_timeout=900.0)
    for name, losses in results[1].items():  # the last stage computes the loss
        print(name, losses)
        torch.testing.assert_close(losses["ours"], losses["DeepSpeed"], rtol=1e-5, atol=1e-6)
