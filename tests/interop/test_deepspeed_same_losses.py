"""DeepSpeed's AlexNet pipeline example trains the same under DeepSpeed and under our port:
the loss of every step equal, from the example's own ds_config (skipped without DeepSpeed).

Both engines run in the same two gloo processes (DS_ACCELERATOR=cpu), from the same
`training_data` through their own loaders (so data order, microbatch split and repetition
are compared too), with the example's model (`join_layers(AlexNet(num_classes=10))`, the
``parameters`` partition) built from the same seed. What is held fixed, and why:

- the optimizer implementation: ``"torch_adam": true`` makes DeepSpeed step torch's AdamW,
  as we do (its default FusedAdam is a compiled kernel with other rounding);
- ``"gradient_clipping": 0``: DeepSpeed's default clips at 1.0, but its pipeline engine's
  norm counts only the first stage's gradients (``clip_grad_norm_`` keeps a parameter when
  ``mpu.get_model_parallel_rank() == 0``, and a pipeline grid's "model parallel rank" is the
  stage index), so every later stage is clipped by the wrong norm; we clip by the norm over
  every stage, as a single process does;
- dropout is 0: DeepSpeed draws dropout masks from each rank's global generator, we from
  per-layer streams seeded by (layer, step, microbatch) so that masks do not depend on the
  partition; with dropout both train correctly but with different masks.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
STEPS, SIDE, SAMPLES, SEED = 4, 64, 12, 1138

deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")


def example_config(**optimizer_params: Any) -> dict[str, Any]:
    """The example's ds_config (DeepSpeedExamples training/pipeline_parallelism), batch sizes
    shrunk for a test: 8 samples a step in microbatches of 2 (gradient_accumulation_steps 4);
    12 samples, so step 2 wraps around the data."""
    config = json.loads((ROOT / "examples" / "deepspeed_alexnet" / "ds_config.json").read_text())
    config.update(train_batch_size=8, train_micro_batch_size_per_gpu=2, steps_per_print=10**6,
                  gradient_clipping=0)
    config["optimizer"]["params"].update(optimizer_params)
    return config


def _model(num_stages: int, pipeline_module: Any) -> Any:
    sys.path.insert(0, str(ROOT / "examples" / "deepspeed_alexnet"))
    from train import AlexNet, join_layers  # the example's own model and layer list

    torch.manual_seed(SEED)
    return pipeline_module(layers=join_layers(AlexNet(num_classes=10, dropout=0.0)),
                           loss_fn=torch.nn.CrossEntropyLoss(), num_stages=num_stages,
                           partition_method="parameters", activation_checkpoint_interval=0)


def _dataset() -> Any:
    sys.path.insert(0, str(ROOT / "examples" / "deepspeed_alexnet"))
    from train import SyntheticCifar

    return SyntheticCifar(size=SAMPLES, side=SIDE)


def _losses_both(config: dict[str, Any]) -> dict[str, list[float]]:
    """Per rank: train STEPS steps with each engine; the loss sequences."""
    import deepspeed as ds
    from deepspeed.pipe import PipelineModule as DSPipelineModule

    import pipeline
    from pipeline import PipelineModule

    torch.set_num_threads(1)
    world = dist.get_world_size()
    ours, _, _, _ = pipeline.initialize(model=_model(world, PipelineModule), config=config,
                                        training_data=_dataset())
    ds.init_distributed(dist_backend="gloo")
    module = _model(world, DSPipelineModule)
    theirs, _, _, _ = ds.initialize(
        model=module, model_parameters=[p for p in module.parameters() if p.requires_grad],
        config=config, training_data=_dataset())
    torch.set_num_threads(1)
    return {"DeepSpeed": [float(theirs.train_batch()) for _ in range(STEPS)],
            "ours": [float(ours.train_batch()) for _ in range(STEPS)]}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_deepspeed_example_loss_sequence_equals_deepspeed(monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    from pipeline import launch

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]))
    config = example_config(torch_adam=True)
    results = launch(_losses_both, 2, config, timeout=600.0, join_timeout=900.0)
    losses = results[0]
    rows = [f"| {step + 1} | {theirs:.7f} | {ours:.7f} | {abs(ours - theirs):.1e} |"
            for step, (theirs, ours) in enumerate(zip(losses["DeepSpeed"], losses["ours"]))]
    table = "| step | DeepSpeed | ours | abs diff |\n|---|---|---|---|\n" + "\n".join(rows)
    (tmp_path / "losses.md").write_text(table)
    print(table)
    assert results[1] == losses  # every rank reports the same sequence
    torch.testing.assert_close(losses["ours"], losses["DeepSpeed"], rtol=1e-5, atol=1e-6)
