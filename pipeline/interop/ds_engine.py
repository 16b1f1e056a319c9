"""DeepSpeed's `PipelineEngine` methods over ours, and its `RepeatingLoader`."""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from pipeline.errors import PipelineConfigError
from pipeline.interop.ds_client_state import CLIENT_STATE, client_state_bytes, read_client_state
from pipeline.interop.ds_config import DSConfig
from pipeline.parallel.zero import ShardedOptimizer
from pipeline.runtime.engine import PipelineEngine
from pipeline.runtime.inference import Inference
from pipeline.runtime.loss_normalization import is_summed

__all__ = ["DeepSpeedPipelineEngine", "RepeatingLoader"]


class RepeatingLoader:
    """Iterate a loader forever, restarting it when it ends (DeepSpeed's name)."""

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self._iterator = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._iterator)
        except StopIteration:
            self._iterator = iter(self.loader)
            return next(self._iterator)



class DeepSpeedPipelineEngine:
    """DeepSpeed's `PipelineEngine` methods over ours; `engine` is the wrapped engine."""

    def __init__(self, engine: PipelineEngine, config: DSConfig, *,
                 training_data: Dataset[Any] | None, collate_fn: Any = None,
                 lr_scheduler: Any = None) -> None:
        self.engine = engine
        self.config = config
        self.module = engine.module
        self.lr_scheduler = lr_scheduler
        self.global_steps = 0
        self.global_samples = 0
        self.training_dataloader: DataLoader[Any] | None = None
        self.data_iterator: Iterator[Any] | None = None
        if training_data is not None:
            self.training_dataloader = self.deepspeed_io(training_data, collate_fn=collate_fn)
            self.data_iterator = iter(RepeatingLoader(self.training_dataloader))
        self._inference: Inference | None = None
        self._step_start = time.perf_counter()
        self.device = engine.device
        self.global_rank = dist.get_rank()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.world_size = dist.get_world_size()

    # -- facts -----------------------------------------------------------------------------

    @property
    def optimizer(self) -> Any:
        return self.engine.optimizer

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        return self.config.zero_stage

    def fp16_enabled(self) -> bool:
        return self.config.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.config.precision == "bf16"

    def gradient_clipping(self) -> float:
        """The clipping norm, 0.0 when off (DeepSpeed's answer)."""
        return self.config.gradient_clipping or 0.0

    def steps_per_print(self) -> int | None:
        return self.config.steps_per_print

    def is_first_stage(self) -> bool:
        return self.engine.is_first_stage()

    def is_last_stage(self) -> bool:
        return self.engine.is_last_stage()

    def was_step_applied(self) -> bool:
        return not self.engine.last_step_skipped

    def get_lr(self) -> list[float]:
        torch_optimizer = self._torch_optimizer()
        return [] if torch_optimizer is None else [
            group["lr"] for group in torch_optimizer.param_groups]

    def _torch_optimizer(self) -> torch.optim.Optimizer | None:
        optimizer = self.engine.optimizer
        if isinstance(optimizer, ShardedOptimizer):
            return optimizer.optimizer
        return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None

    # -- data ------------------------------------------------------------------------------

    def deepspeed_io(self, dataset: Dataset[Any], *, collate_fn: Any = None
                     ) -> DataLoader[Any]:
        """A loader of microbatches for this rank's data-parallel replica, as DeepSpeed's
        pipeline engine builds it: samples in order (no shuffle), replica r taking every
        dp-th one from r, and the last short microbatch kept unless the config says
        ``dataloader_drop_last``. Every rank of a pipeline draws the same samples, so the
        first stage's inputs meet the last stage's labels."""
        position = self.engine.position
        sampler: DistributedSampler[Any] = DistributedSampler(
            dataset, num_replicas=self.engine.topology.dp, rank=position.dp_rank, shuffle=False)
        return DataLoader(dataset, batch_size=self.config.micro_batch_size, sampler=sampler,
                          collate_fn=collate_fn, drop_last=self.config.dataloader_drop_last)

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        self.data_iterator = iterator

    def _iterator(self, data_iter: Iterator[Any] | None) -> Iterator[Any]:
        if data_iter is not None:
            return data_iter
        if self.data_iterator is None:
            raise PipelineConfigError("train_batch() has no data: pass "
                                      "initialize(training_data=dataset) or "
                                      "train_batch(data_iter=iterator of (inputs, labels))")
        return self.data_iterator

    # -- steps -----------------------------------------------------------------------------

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """One optimizer step over gradient_accumulation_steps microbatches drawn from
        `data_iter` (or the training data's loader); the mean loss on every rank. A loss
        with ``reduction == "sum"`` and ``count`` is weighted by its count instead (the
        engine's `train_batch` does it)."""
        iterator = self._iterator(data_iter)
        loss = self.engine.train_batch(data_iter=iterator)
        if self.lr_scheduler is not None and not self.engine.last_step_skipped:
            self.lr_scheduler.step()
        self.global_steps += 1
        self.global_samples += self.config.train_batch_size
        self._report(loss)
        return torch.tensor(loss)

    def eval_batch(self, data_iter: Iterator[Any] | None = None, return_logits: bool = False,
                   compute_loss: bool = True, num_micro_batches: int | None = None,
                   **_: Any) -> Any:
        """Forward `num_micro_batches` microbatches (default gradient_accumulation_steps)
        from `data_iter` (or the training data). Returns the mean loss on every rank (token
        weighted for a summed loss at the default m), and with `return_logits` also the
        last stage's outputs, broadcast to every rank of the pipeline."""
        iterator = self._iterator(data_iter)
        m = num_micro_batches or self.config.gradient_accumulation_steps
        outputs = None
        if is_summed(self.module.loss_fn) and compute_loss and not return_logits and \
                m == self.config.gradient_accumulation_steps:
            self.engine.eval_batch(data_iter=iterator)
            value = self.engine.last_loss
        else:
            if self._inference is None:
                self._inference = Inference(self.engine)
            outputs = self._inference.eval_batch(num_microbatches=m, data_iter=iterator,
                                                 broadcast=return_logits)
            value = self._inference.last_loss
        loss = torch.tensor(value if value is not None else float("nan"))
        return (loss, outputs) if return_logits else loss

    def _report(self, loss: float) -> None:
        every = self.config.steps_per_print
        if every is None or self.global_steps % every or self.global_rank != 0:
            return
        now = time.perf_counter()
        elapsed = (now - self._step_start) / every
        self._step_start = now
        print(f"steps: {self.global_steps} loss: {loss:0.4f} iter time (s): {elapsed:0.3f} "
              f"samples/sec: {self.config.train_batch_size / elapsed:0.3f}", flush=True)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineConfigError("a pipeline engine runs whole steps: call train_batch() / "
                                  "eval_batch() instead of engine(inputs), backward, step")

    __call__ = forward
    backward = forward
    step = forward

    # -- checkpoints -----------------------------------------------------------------------

    def save_checkpoint(self, save_dir: str, tag: str | None = None,
                        client_state: Mapping[str, Any] | None = None) -> bool:
        """Weights, optimizer, generators (our crash-safe format) plus the scheduler and
        `client_state` (a collective)."""
        if tag is not None:
            warnings.warn("save_checkpoint(tag=) is ignored: checkpoints are step_<N>",
                          stacklevel=2)
        extra_files = {}
        if self.global_rank == 0:  # inside the step directory, listed (and signed) in its
            # manifest, written before the commit: a resume reads nothing unchecked
            extra_files[CLIENT_STATE] = client_state_bytes(
                {"client_state": dict(client_state or {}),
                 "lr_scheduler": None if self.lr_scheduler is None
                 else self.lr_scheduler.state_dict(),
                 "global_samples": self.global_samples})
        self.engine.save_checkpoint(save_dir, extra_files=extra_files)
        return True

    def load_checkpoint(self, load_dir: str, tag: str | None = None,
                        load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True) -> tuple[str, dict[str, Any]]:
        """Load (the latest, or `tag`'s step directory); returns (path, client_state)."""
        source = str(Path(load_dir) / tag) if tag is not None else load_dir
        info = self.engine.load_checkpoint(source, load_optimizer=load_optimizer_states)
        self.global_steps = info.step
        extra = read_client_state(Path(info.directory))
        if load_lr_scheduler_states and self.lr_scheduler is not None and extra.get(
                "lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        self.global_samples = int(extra.get("global_samples", 0))
        return info.directory, dict(extra.get("client_state", {}))
