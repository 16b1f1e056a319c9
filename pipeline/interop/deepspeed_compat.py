"""DeepSpeed's pipeline API on `PipelineEngine`: a DeepSpeed script runs with its imports changed.

    import pipeline.interop.deepspeed_compat as deepspeed
    from pipeline.interop.deepspeed_compat import PipelineModule, RepeatingLoader

``deepspeed.initialize(args=, model=, config=, training_data=)`` reads the ds_config keys a
pipeline job uses (`pipeline.interop.ds_config`) and returns ``(engine, optimizer,
dataloader, lr_scheduler)``; the engine has DeepSpeed's method names (``train_batch()``
over its data iterator, ``eval_batch``, ``gradient_accumulation_steps()``, ...). It wraps a
`PipelineEngine` through its public methods only.
"""

from __future__ import annotations

import argparse
import atexit
import os
import random
import sys
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from pipeline.device import default_backend, default_device
from pipeline.device.staged_backend import backend_available
from pipeline.errors import PipelineConfigError
from pipeline.interop.ds_client_state import read_client_state
from pipeline.interop.ds_clipping import ClipNorm, check_clip_norm, use_clip_norm
from pipeline.interop.ds_config import make_optimizer_factory, make_scheduler, read_ds_config
from pipeline.interop.ds_engine import DeepSpeedPipelineEngine, RepeatingLoader
from pipeline.interop.ds_module import PipelineModule, built_early
from pipeline.interop.ds_param_groups import optimizer_for_initialize
from pipeline.model.layers import LayerSpec
from pipeline.model.module import PipelineModule as LazyPipelineModule
from pipeline.model.tied import TiedLayerSpec
from pipeline.runtime.engine import PipelineEngine

__all__ = ["DeepSpeedPipelineEngine", "LayerSpec", "PipelineModule", "RepeatingLoader",
           "TiedLayerSpec", "add_config_arguments", "init_distributed", "initialize",
           "read_client_state", "runtime"]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--deepspeed`` and ``--deepspeed_config`` (DeepSpeed's command-line flags)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable the DeepSpeed-style engine (always on here)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed JSON configuration file")
    return parser


def init_distributed(dist_backend: str = "gloo", **kwargs: Any) -> None:
    """Initialise the default process group from the launcher's environment (torchrun's or
    DeepSpeed's RANK / WORLD_SIZE / MASTER_ADDR). NCCL becomes what `default_backend` picks:
    gloo without CUDA, gloo beside NCCL for CPU tensors, the staged path on a shared GPU."""
    if dist.is_initialized():
        return
    backend = default_backend() if dist_backend == "nccl" else dist_backend
    backend_available(backend)  # registers the staged backend where it is named
    for name, default in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                          ("MASTER_PORT", "29500"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(name, default)
    dist.init_process_group(backend=backend, **kwargs)


def _set_random_seed(seed: int) -> None:
    """Seed Python, numpy and torch (DeepSpeed's ``runtime.utils.set_random_seed``)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


runtime = SimpleNamespace(utils=SimpleNamespace(set_random_seed=_set_random_seed))
"""``deepspeed.runtime.utils.set_random_seed`` as scripts call it."""



def _shut_down(engine: PipelineEngine) -> None:
    """At exit of a script run under torchrun (no `pipeline.launch` to clean up): stop the
    engine's watchdog before the process group it polls goes away (else the store client can
    be torn down under it and the process aborts), then destroy the group."""
    engine.stop_watchdog()
    if dist.is_initialized():
        dist.destroy_process_group()


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    for value in (config, config_params, getattr(args, "deepspeed_config", None)):
        if value is not None:
            return value
    raise PipelineConfigError("no DeepSpeed config: pass initialize(config=path or dict) or "
                              "--deepspeed_config path (add_config_arguments(parser))")


_DEEPSPEED_OPTIONS: dict[str, Any] = {"distributed_port": None, "dist_init_required": None,
                                      "mpu": None, "mesh_param": None}
"""DeepSpeed's other ``initialize`` keywords, accepted at the value that changes nothing here
(any port: the process group comes from the launcher's environment)."""


def _check_deepspeed_options(options: Mapping[str, Any]) -> None:
    """Refuse keywords that would be dropped silently (a typo, or a DeepSpeed feature the
    port does not have)."""
    problems = []
    for key, value in options.items():
        if key not in _DEEPSPEED_OPTIONS:
            problems.append(f"{key}= is not an initialize() keyword here (DeepSpeed's are "
                            f"{sorted(_DEEPSPEED_OPTIONS)}; ours: schedule, clip_norm, "
                            "dynamic_shapes, timeout)")
        elif key in ("mpu", "mesh_param") and value is not None:
            problems.append(f"{key}= is not available: the pipeline's pp × dp grid comes from "
                            "num_stages and the world size")
    if problems:
        raise PipelineConfigError("; ".join(problems))


def initialize(args: Any = None, model: LazyPipelineModule | None = None,
               optimizer: Any = None, model_parameters: Any = None,
               training_data: Dataset[Any] | None = None, lr_scheduler: Any = None,
               collate_fn: Any = None, config: str | Path | Mapping[str, Any] | None = None,
               config_params: Any = None, *, schedule: str = "1f1b",
               clip_norm: ClipNorm = "global", dynamic_shapes: bool = False,
               timeout: float = 300.0, **deepspeed_options: Any
               ) -> tuple[DeepSpeedPipelineEngine, Any, DataLoader[Any] | None, Any]:
    """DeepSpeed's ``initialize`` for a `PipelineModule`: (engine, optimizer, training
    dataloader, lr_scheduler). `model_parameters` (tensors or parameter groups) and a
    client `optimizer` are honoured as DeepSpeed honours them
    (`pipeline.interop.ds_param_groups`); both need the module built at construction
    (this module's `PipelineModule`, made after `init_distributed`). Without them each
    rank's optimizer takes its own stages' parameters once they are built. `schedule`
    picks any of our schedules (DeepSpeed has only 1F1B). `clip_norm` says which
    gradients the clipping norm counts: "global" (default: every stage's, as one process
    computes it) or "first_stage" (stage 0's only, as DeepSpeed 0.19.8's fp32 pipeline
    does: `pipeline.interop.ds_clipping`), to reproduce a DeepSpeed run step for step.
    `dynamic_shapes` is the engine's (microbatches of varying shapes, e.g. a short last
    one). DeepSpeed's other keywords are accepted at values that change nothing here."""
    _check_deepspeed_options(deepspeed_options)
    if not isinstance(model, LazyPipelineModule):
        raise TypeError(f"initialize(model=) needs a PipelineModule, got "
                        f"{type(model).__name__}; wrap the layers: PipelineModule(layers=..., "
                        "num_stages=..., loss_fn=...)")
    if not dist.is_initialized():
        init_distributed()
    world = dist.get_world_size()
    if world % model.num_stages:
        raise PipelineConfigError(f"world size {world} is not a multiple of num_stages="
                                  f"{model.num_stages}")
    ds = read_ds_config(_config_source(args, config, config_params),
                        data_parallel=world // model.num_stages)
    if ds.no_effect and dist.get_rank() == 0:
        print(f"[pipesched] ds_config keys that only tune DeepSpeed's communication (nothing "
              f"computed changes): {list(ds.no_effect)}", file=sys.stderr)
    check_clip_norm(clip_norm, zero_stage=ds.zero_stage, precision=ds.precision)
    if optimizer is not None and ds.optimizer is not None:
        raise PipelineConfigError("an optimizer is both in the config and passed to "
                                  "initialize(optimizer=); keep one")
    factory = optimizer_for_initialize(
        optimizer, model_parameters,
        make_optimizer_factory(ds.optimizer) if ds.optimizer is not None else None, model)
    if built_early(model):
        model.to(default_device())  # in place: the optimizer's tensors stay the module's
    engine = PipelineEngine(
        model, schedule=schedule, num_microbatches=ds.gradient_accumulation_steps,
        optimizer=factory, data_parallel=world // model.num_stages, zero_stage=ds.zero_stage,
        precision=ds.precision, dynamic_shapes=dynamic_shapes,
        gradient_clipping=ds.gradient_clipping, initial_loss_scale=ds.initial_loss_scale,
        loss_scale_window=ds.loss_scale_window, timeout=timeout)
    atexit.register(_shut_down, engine)
    use_clip_norm(engine, clip_norm)
    wrapped = DeepSpeedPipelineEngine(engine, ds, training_data=training_data,
                                      collate_fn=collate_fn)
    torch_optimizer = wrapped._torch_optimizer()
    if lr_scheduler is None and ds.scheduler is not None and torch_optimizer is not None:
        lr_scheduler = make_scheduler(ds.scheduler, torch_optimizer)
    elif callable(lr_scheduler) and torch_optimizer is not None and not hasattr(
            lr_scheduler, "step"):
        lr_scheduler = lr_scheduler(torch_optimizer)
    wrapped.lr_scheduler = lr_scheduler
    return wrapped, engine.optimizer, wrapped.training_dataloader, lr_scheduler
