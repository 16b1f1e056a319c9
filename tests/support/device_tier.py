"""Per-rank checks of the device tier (`tests/cuda/`): the engine on a GPU against the
single-process CPU reference, rehearsed on CPU ranks through the staged backend.

On a CUDA machine the ranks run on the GPU(s) with the backend `launch` picks (nccl with a
GPU per rank, the staged gloo path where ranks share one); `PIPESCHED_DEVICE_TIER=cpu` runs
the same checks on CPU ranks through ``cpu:pipesched_staged_host``, which copies every
message through host buffers as the GPU path does.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline import PipelineEngine, PipelineModule
from pipeline.device import default_device, device_memory_allocated
from pipeline.model.reference import build_reference, reference_step
from pipeline.parallel.model_state import count_model_states
from schedules import SCHEDULES
from tests.support.engine3d_models import OPTIMIZERS, Case, run_case
from tests.support.pipeline_models import MODELS

__all__ = [
    "DEVICE_CASES",
    "REHEARSAL_BACKEND",
    "checkpoint_round_trip",
    "generate_on_device",
    "memory_against_accounting",
    "planted_unwaited_receive",
    "schedule_errors",
    "three_d_results",
    "tier_device_type",
    "tier_launch_options",
]

REHEARSAL_BACKEND = "cpu:pipesched_staged_host"
"""The staged path on CPU ranks (every message through host buffers)."""

DEVICE_CASES = [
    Case("pp2×dp2", "mlp", {"data_parallel": 2}),
    Case("pp2×tp2 +clip", "tp", {"tensor_parallel": 2, "gradient_clipping": 0.05}),
    Case("pp2×dp2 ZeRO-1 +clip", "mlp", {"data_parallel": 2, "zero_stage": 1,
                                         "gradient_clipping": 0.05, "bucket_mb": 2**-10},
         optimizer="adam"),
    Case("tied pp2×dp2 ZeRO-1 overlap_param_gather", "tied",
         {"data_parallel": 2, "zero_stage": 1, "overlap_param_gather": True,
          "bucket_mb": 2**-10}, optimizer="adam"),
    Case("bf16 half params pp2×dp2 ZeRO-1", "mlp",
         {"data_parallel": 2, "zero_stage": 1, "precision": "bf16", "half_parameters": True,
          "bucket_mb": 2**-10}),
    Case("fp16 loss scaling pp2×dp2", "mlp",
         {"data_parallel": 2, "precision": "fp16", "initial_loss_scale": 2.0**10}),
]
"""The 3D configurations the tier runs on the device (4 ranks)."""


def tier_device_type() -> str | None:
    """``cuda`` on a CUDA machine, ``cpu`` when PIPESCHED_DEVICE_TIER=cpu asks for the
    rehearsal, else None (the tier skips)."""
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if os.environ.get("PIPESCHED_DEVICE_TIER") == "cpu" else None


def tier_launch_options() -> dict[str, Any]:
    """`launch` keywords of the tier: the default backend on a GPU, the staged one on CPU."""
    return {} if torch.cuda.is_available() else {"backend": REHEARSAL_BACKEND}


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float().cpu() - b.float().cpu()).abs().max()) if a.numel() else 0.0


def schedule_errors(names: tuple[str, ...] | None = None) -> dict[str, dict[str, float]]:
    """Every registered training schedule (or those `names`) at pp = 2 on this rank's device,
    two SGD steps of the MLP: the largest loss, gradient and parameter differences from the
    CPU reference."""
    spec, m = MODELS["mlp"], 4  # m = 2p: DualPipeV's smallest
    found: dict[str, dict[str, float]] = {}
    for name, entry in SCHEDULES.items():
        if name == "forward-only" or (names is not None and name not in names):
            continue
        module = PipelineModule(spec.layers(), num_stages=2, chunks=entry.default_chunks,
                                loss_fn=spec.loss)
        engine = PipelineEngine(module, schedule=name, num_microbatches=m,
                                optimizer=OPTIMIZERS["sgd"], timeout=60,
                                device=default_device())
        reference = build_reference(spec.layers())
        errors = {"loss": 0.0, "grad": 0.0, "param": 0.0}
        for step in range(2):
            inputs, targets = spec.batch(seed=step, batch=3 * m, length=spec.lengths[0])
            loss = engine.train_batch(inputs, targets)
            expected = reference_step(reference, inputs, targets, loss_fn=spec.loss,
                                      optimizer=OPTIMIZERS["sgd"])
            errors["loss"] = max(errors["loss"], abs(loss - expected.loss))
            for key, param in module.named_layer_parameters():
                assert param.grad is not None, f"{name}: no gradient for {key}"
                errors["grad"] = max(errors["grad"], _error(param.grad, expected.grads[key]))
                errors["param"] = max(errors["param"], _error(param, expected.params[key]))
        engine.stop_watchdog()
        found[name] = errors
    return found


def three_d_results() -> list[dict[str, Any]]:
    """`DEVICE_CASES` on this rank's device against the CPU reference (4 ranks)."""
    torch.manual_seed(0)
    return [run_case(case, default_device()) for case in DEVICE_CASES]


def _engine(device: torch.device) -> PipelineEngine:
    spec = MODELS["mlp"]
    module = PipelineModule(spec.layers(), num_stages=2, loss_fn=spec.loss, base_seed=7)
    return PipelineEngine(module, schedule="1f1b", num_microbatches=4,
                          optimizer=OPTIMIZERS["adam"], data_parallel=2, zero_stage=1,
                          timeout=60, device=device)


def _train(engine: PipelineEngine, steps: int) -> list[float]:
    spec, losses = MODELS["mlp"], []
    for _ in range(steps):  # the batch depends on the step only: a resumed run sees the same
        inputs, targets = spec.batch(seed=engine.global_step, batch=16, length=1)
        mine = slice(8 * engine.position.dp_rank, 8 * engine.position.dp_rank + 8)
        losses.append(engine.train_batch(inputs[mine], targets[mine]))
    return losses


def checkpoint_round_trip(root: str) -> dict[str, list[float]]:
    """ZeRO-1 pp2×dp2: two steps on the device and a save; the next two steps straight on,
    after loading on the CPU, and after loading that CPU run's save back on the device."""
    device = default_device()
    engine = _engine(device)
    _train(engine, 2)
    engine.save_checkpoint(f"{root}/device")
    straight = _train(engine, 2)
    engine.stop_watchdog()
    on_cpu = _engine(torch.device("cpu"))
    on_cpu.load_checkpoint(f"{root}/device")
    from_device = _train(on_cpu, 2)
    on_cpu.save_checkpoint(f"{root}/cpu")
    on_cpu.stop_watchdog()
    back = _engine(device)
    back.load_checkpoint(f"{root}/device")
    again = _train(back, 2)
    back.stop_watchdog()
    return {"straight": straight, "on_cpu": from_device, "back_on_device": again}


def generate_on_device(family: str) -> dict[str, list[list[int]]]:
    """Greedy tokens of a tiny HF model through the pipeline on the device, and HF's own on
    the CPU (2 ranks)."""
    from pipeline.interop.hf_layers import layers_from_hf
    from pipeline.interop.hf_weights import load_hf_weights
    from pipeline.runtime.generation import greedy_generate
    from pipeline.runtime.inference import Inference
    from tests.support.hf_models import tiny_config, tiny_model

    hf_model = tiny_model(family, seed=7)
    hf_model.generation_config.eos_token_id = None
    hf = layers_from_hf(tiny_config(family))
    module = PipelineModule(hf.layers, num_stages=2, loss_fn=hf.loss_fn,
                            partition_method="uniform")
    load_hf_weights(module, hf, hf_model.state_dict())
    engine = PipelineEngine(module, schedule="1f1b", num_microbatches=2, timeout=60,
                            device=default_device())
    ids = torch.randint(1, 50, (4, 8), generator=torch.Generator().manual_seed(11))
    ours = greedy_generate(Inference(engine), ids, 6)
    theirs = hf_model.generate(ids, attention_mask=torch.ones_like(ids),  # type: ignore[operator]
                               max_new_tokens=6, do_sample=False, pad_token_id=0,
                               eos_token_id=[])
    engine.stop_watchdog()
    return {"ours": ours.cpu().tolist(), "hf": theirs.tolist()}


def memory_against_accounting() -> list[dict[str, Any]]:
    """After one Adam step of wide linear layers (pp2×dp2, ZeRO 0 and 1): the model-state
    bytes counted from the live tensors, and the device allocator's own figure (None on a
    CPU), on each rank."""
    rows = []
    for zero in (0, 1):
        torch.manual_seed(0)
        layers = [nn.Linear(512, 512) for _ in range(4)]
        module = PipelineModule(layers, num_stages=2, loss_fn=F.mse_loss)
        device = default_device()
        before = device_memory_allocated(device)
        engine = PipelineEngine(module, optimizer=OPTIMIZERS["adam"], num_microbatches=2,
                                data_parallel=2, zero_stage=zero, timeout=60, device=device)
        engine.train_batch(torch.randn(8, 512), torch.randn(8, 512))
        counted = count_model_states(module, engine.optimizer).total
        after = device_memory_allocated(device)
        rows.append({"zero": zero, "counted": counted,
                     "allocated": None if after is None or before is None else after - before})
        engine.stop_watchdog()
        del engine, module
    return rows


def planted_unwaited_receive() -> dict[str, float] | str:
    """A planted bug: every receive is used without waiting for it, i.e. read before its data
    lands (what it then holds is modelled as a fresh zeroed buffer, so the bug cannot pass by
    luck). The transfer itself still completes, as it does on a GPU: the peers' sends are
    not left waiting for gloo's timeout, and the 1F1B case must differ by the check's own
    tolerance (or fail outright)."""
    from pipeline.runtime import comm

    waited = comm.PendingRecv.wait

    def unwaited(self: comm.PendingRecv) -> list[torch.Tensor]:
        read = [torch.zeros_like(buffer) for buffer in self.buffers]  # before the data
        waited(self)  # the copy lands later, unseen by the compute that already read
        return read

    comm.PendingRecv.wait = unwaited  # type: ignore[method-assign]
    try:
        return schedule_errors(("1f1b",))["1f1b"]
    except Exception as error:  # the run may also break outright
        return f"{type(error).__name__}: {error}"
    finally:
        comm.PendingRecv.wait = waited  # type: ignore[method-assign]
