"""One point of the planner's search: what `PipelineEngine` and `pipesched train` are told."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.planner.errors import PlanError

__all__ = ["RECOMPUTE_MODES", "PlanConfig"]

RECOMPUTE_MODES = ("none", "selective", "full")
_RECOMPUTE_TAGS = {"none": "", "selective": " rs", "full": " rc"}


@dataclass(frozen=True, order=True, kw_only=True)
class PlanConfig:
    """One point of the search: everything `PipelineEngine` and `pipesched train` are told."""

    pp: int
    tp: int
    dp: int
    schedule: str
    chunks: int
    microbatch_size: int
    num_microbatches: int
    zero_stage: int
    recompute: str
    """none, selective (attention's core) or full (whole layers); True / False are read as
    full / none."""
    recompute_layers: int = 0
    """Partial recomputation: only the first k layers of each stage; 0: all of them."""
    ep: int = 1
    """Expert parallelism: ep of each stage's dp × cp replicas split every MoE layer's
    experts (ep divides dp · cp and the experts, carved from dp × cp as the engine and
    Megatron-Core do; 1 for a dense model)."""
    cp: int = 1
    """Context parallelism: cp ranks split each sequence (2·cp chunks, K/V all-gathered)."""

    def __post_init__(self) -> None:
        if type(self.cp) is not int or self.cp < 1:
            raise PlanError(f"cp={self.cp!r} must be a whole number >= 1")
        replicas = self.dp * self.cp
        if type(self.ep) is not int or (self.ep != 1 and (self.ep < 1 or replicas % self.ep)):
            valid = ", ".join(str(k) for k in range(1, replicas + 1) if replicas % k == 0)
            over = f"dp={self.dp} × cp={self.cp} = {replicas}" if self.cp > 1 else \
                f"dp={self.dp}"
            raise PlanError(f"ep={self.ep!r} must be a whole number >= 1 dividing {over} "
                            f"(the experts are split over the dp × cp replicas, as the "
                            f"engine carves ep); use one of {valid}")
        if isinstance(self.recompute, bool):
            object.__setattr__(self, "recompute", "full" if self.recompute else "none")
        if self.recompute not in RECOMPUTE_MODES:
            raise PlanError(f"recompute={self.recompute!r} must be one of "
                            f"{', '.join(RECOMPUTE_MODES)}")
        if isinstance(self.recompute_layers, bool) or not isinstance(self.recompute_layers, int) \
                or self.recompute_layers < 0 or (self.recompute_layers and
                                                 self.recompute == "none"):
            raise PlanError(f"recompute_layers={self.recompute_layers!r} must be 0 (all) or the "
                            f"k >= 1 first layers of each stage, with recompute selective or full")

    @classmethod
    def enumerated(cls, *, pp: int, tp: int, dp: int, schedule: str, chunks: int,
                   microbatch_size: int, num_microbatches: int, zero_stage: int,
                   recompute: str, recompute_layers: int, ep: int, cp: int = 1) -> PlanConfig:
        """A configuration the search's enumeration made, valid by construction (ep one of
        `expert_sizes`, recompute and recompute_layers from its modes): made without
        `__post_init__`'s checks, which cost as much as the rest of making one, ~10^5 times
        a search. Equal to, and hashed and ordered as, `PlanConfig(...)` of the same values
        (a test makes every enumerated one that way too)."""
        config = object.__new__(cls)
        config.__dict__.update(pp=pp, tp=tp, dp=dp, schedule=schedule, chunks=chunks,
                               microbatch_size=microbatch_size,
                               num_microbatches=num_microbatches, zero_stage=zero_stage,
                               recompute=recompute, recompute_layers=recompute_layers, ep=ep,
                               cp=cp)
        return config

    @property
    def recomputes(self) -> bool:
        return self.recompute != "none"

    def recompute_label(self) -> str:
        """none, selective, full or partial-k (full on the first k layers of each stage)."""
        if self.recompute_layers:
            return f"{'partial' if self.recompute == 'full' else 'selective'}-" \
                   f"{self.recompute_layers}"
        return self.recompute

    def engine_arguments(self) -> dict[str, Any]:
        """Keyword arguments of `PipelineModule` (num_stages, chunks, recompute,
        recompute_layers) and `PipelineEngine`."""
        return {"num_stages": self.pp, "chunks": self.chunks, "recompute": self.recompute,
                "recompute_layers": self.recompute_layers or None,
                "schedule": self.schedule, "num_microbatches": self.num_microbatches,
                "data_parallel": self.dp, "tensor_parallel": self.tp,
                "zero_stage": self.zero_stage} | (
                    {"expert_parallel": self.ep} if self.ep > 1 else {}) | (
                    {"context_parallel": self.cp} if self.cp > 1 else {})

    def train_command(self, global_batch: int, expert_tensor_parallel: int = 1) -> str:
        """The `pipesched train` arguments of this configuration: its parallel sizes as the
        command's flags (`--tp`, `--cp`, `--expert-parallel`, `--expert-tensor-parallel`,
        which take a `--model` recipe of split or MoE layers: the demo LM has none);
        recomputation, which the command has no switch for, named."""
        switches = "".join(flag for flag, on in (
            (f" --tp {self.tp}", self.tp > 1), (f" --cp {self.cp}", self.cp > 1),
            (f" --expert-parallel {self.ep}", self.ep > 1),
            (f" --expert-tensor-parallel {expert_tensor_parallel}",
             expert_tensor_parallel > 1)) if on)
        text = (f"pipesched train --schedule {self.schedule} --stages {self.pp} "
                f"--chunks {self.chunks} --microbatches {self.num_microbatches} "
                f"--data-parallel {self.dp} --batch-size {global_batch}"
                + (f" --zero-stage {self.zero_stage}" if self.zero_stage else "") + switches)
        notes = (["--model MODULE:FUNCTION: a recipe of split or MoE layers (the demo LM "
                  "has none)"] if switches else []) + (
            [f"recompute={self.recompute_label()}: PipelineEngine only"]
            if self.recomputes else [])
        return text + (f"   # plus {'; '.join(notes)}" if notes else "")

    def label(self) -> str:
        v = f" v{self.chunks}" if self.chunks > 1 else ""
        ep = f" ep{self.ep}" if self.ep > 1 else ""
        cp = f" cp{self.cp}" if self.cp > 1 else ""
        return (f"pp{self.pp} tp{self.tp} dp{self.dp}{cp}{ep} {self.schedule}{v} "
                f"b{self.microbatch_size}"
                f" m{self.num_microbatches} z{self.zero_stage}{_RECOMPUTE_TAGS[self.recompute]}"
                f"{self.recompute_layers or ''}")
