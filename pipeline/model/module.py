"""`PipelineModule`: a layer list cut into stages; each rank builds only the stages it holds.

Each built stage is a `pipeline.model.stage.Stage` (re-exported here with `run_layer`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from torch import nn

from pipeline.errors import PipelineConfigError
from pipeline.model.build_context import building_with
from pipeline.model.layer_checks import (
    find_shared_groups,
    hidden_module_problems,
    reaches_existing_weights,
    shared_layer_problems,
    starts_in_place,
    tie_shared_groups,
)
from pipeline.model.layers import Layer, build_layer, check_tied_specs, normalize_layers
from pipeline.model.partitioning import PartitionMethod, stage_boundaries
from pipeline.model.recompute import RecomputeMode, RecomputePolicy
from pipeline.model.stage import Stage, run_layer
from pipeline.model.tied import TiedLayerSpec
from pipeline.parallel.groups import ProcessGroups
from schedules.ir.schedule import count_problem

__all__ = ["LossFn", "PipelineModule", "Stage", "run_layer"]

LossFn = Callable[[Any, Any], torch.Tensor]
"""``loss_fn(outputs, targets)`` -> the mean loss of one microbatch."""


class PipelineModule(nn.Module):
    """A model as a list of layers, cut into ``num_stages · chunks`` contiguous stages.

    The cut is computed (identically) on every rank at construction; no layer is built
    until the engine calls `materialize` with the stages the schedule places on this rank.

    `base_seed` seeds each `LayerSpec`'s weights (``base_seed + index``) and, inside the
    engine, each layer's random draws per step and microbatch (`pipeline.model.layer_rng`),
    so dropout is reproducible and the same under any partition; None leaves both to the
    global generators.
    """

    def __init__(self, layers: Sequence[Layer] | nn.Sequential, num_stages: int, *,
                 chunks: int = 1, loss_fn: LossFn | None = None,
                 partition_method: PartitionMethod = "parameters",
                 activation_checkpoint_interval: int = 0, base_seed: int | None = 1234,
                 tie_shared: bool = False, clone_stage_inputs: bool | None = None,
                 recompute: RecomputeMode = "none", recompute_layers: int | None = None
                 ) -> None:
        super().__init__()
        for name, value, minimum in (("num_stages", num_stages, 1), ("chunks", chunks, 1),
                                     ("activation_checkpoint_interval",
                                      activation_checkpoint_interval, 0)):
            problem = count_problem(name, value, minimum=minimum)
            if problem is not None:
                raise PipelineConfigError(problem)
        if base_seed is not None and (isinstance(base_seed, bool) or not isinstance(base_seed,
                                                                                 int)):
            raise PipelineConfigError(f"base_seed must be an int or None, got {base_seed!r}")
        if loss_fn is not None and not callable(loss_fn):
            raise PipelineConfigError(f"loss_fn must be callable, got {loss_fn!r}")
        for name, flag in (("tie_shared", tie_shared), ("clone_stage_inputs",
                                                          clone_stage_inputs)):
            if not isinstance(flag, bool) and not (flag is None and name != "tie_shared"):
                raise PipelineConfigError(f"{name} must be True or False, got {flag!r}")
        items = _checked_layers(normalize_layers(layers), tie_shared, base_seed)
        self.clone_stage_inputs = clone_stage_inputs
        """Clone received stage inputs: True always, False never, None (default) only where
        the stage's first layer works in place (e.g. ``ReLU(inplace=True)``)."""
        try:
            self.tied_keys = check_tied_specs(items)
            """Layer index -> key of every `TiedLayerSpec` (its copies share weights)."""
        except ValueError as error:
            raise PipelineConfigError(str(error)) from error
        self._tied_specs = {key: cast(TiedLayerSpec, items[index])
                            for index, key in self.tied_keys.items()}
        self._tied_modules: dict[str, nn.Module] = {}  # a plain dict: not registered twice
        self._layer_list: list[Layer | None] = list(items)
        self.num_stages = num_stages
        """Pipeline ranks the model is spread over (DeepSpeed's meaning)."""
        self.chunks = chunks
        """Stages per pipeline rank (v); the model is cut into num_stages · chunks stages."""
        self.loss_fn = loss_fn
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.recompute = RecomputePolicy.of(recompute, recompute_layers,
                                            activation_checkpoint_interval)
        """What each stage recomputes: `recompute` ('none', 'selective': the parts layers
        mark with `pipeline.model.recompute.recompute_region`, e.g. attention's core;
        'full': whole layers, in segments of activation_checkpoint_interval), for the first
        `recompute_layers` layers of each stage (None: all of them)."""
        self.base_seed = base_seed
        self.partition_method = partition_method
        total = num_stages * chunks
        if total > len(items):
            raise PipelineConfigError(
                f"{len(items)} layers cannot fill num_stages × chunks = "
                f"{num_stages} × {chunks} = {total} non-empty stages; use fewer stages or "
                "chunks, or split the model into more layers")
        self.boundaries = stage_boundaries(items, total, partition_method)
        """S+1 cut indices: stage s holds layers boundaries[s] .. boundaries[s+1]-1."""
        self.stages = nn.ModuleDict()
        """The stages built on this rank, keyed by str(stage index)."""
        self._build_hooks: list[Callable[[PipelineModule], None]] = []

    @property
    def num_layers(self) -> int:
        return len(self._layer_list)

    @property
    def total_stages(self) -> int:
        """S = num_stages · chunks."""
        return self.num_stages * self.chunks

    def layers_of(self, stage: int) -> range:
        """Global indices of the layers in `stage`."""
        return range(self.boundaries[stage], self.boundaries[stage + 1])

    def materialize(self, stages: Sequence[int], device: torch.device | None = None, *,
                    groups: ProcessGroups | None = None) -> None:
        """Build the given stages' layers (seeded per layer) on `device`; drop every other
        layer object so this rank holds only its part of the model.

        Layers are built inside `building_with(groups)`: a factory with an unfilled ``group``
        parameter gets this rank's tensor-parallel group. Occurrences of one tied key on this
        rank share one module.
        """
        if self.stages:
            built = sorted(int(key) for key in self.stages)
            if built != sorted(stages):
                raise PipelineConfigError(
                    f"this PipelineModule already holds stages {built} and cannot also "
                    f"be placed as {sorted(stages)}; build a new PipelineModule per engine")
            return
        with building_with(groups):
            for stage in sorted(stages):
                span = self.layers_of(stage)
                modules = [build_layer(self._layer(k), k, base_seed=self.base_seed,
                                       device=device, shared=self._tied_modules) for k in span]
                clone = self.clone_stage_inputs
                if clone is None:
                    clone = stage > 0 and starts_in_place(modules[0])
                self.stages[str(stage)] = Stage(stage, span.start, modules,
                                                self.activation_checkpoint_interval,
                                                self.base_seed, clone,
                                                recompute=self.recompute)
        self._layer_list = [None if not any(k in self.layers_of(s) for s in stages) else layer
                            for k, layer in enumerate(self._layer_list)]
        hooks, self._build_hooks = self._build_hooks, []
        with building_with(groups):  # a hook sees the groups too (which experts are kept)
            for hook in hooks:
                hook(self)

    def on_materialize(self, hook: Callable[[PipelineModule], None]) -> None:
        """Call ``hook(self)`` once this rank's stages are built (at once if they already
        are): e.g. load pretrained weights on the owning rank only, before the engine hands
        the parameters to its optimizer. A hook run by `materialize` sees its groups as
        `pipeline.model.build_context.current_process_groups()`."""
        if not callable(hook):
            raise TypeError(f"on_materialize needs a callable hook(module), got {hook!r}")
        if self.stages:
            hook(self)
        else:
            self._build_hooks.append(hook)

    def layer_definition(self, index: int) -> Layer:
        """Global layer `index` as given (a module, `LayerSpec` or callable), before this rank
        was materialized (e.g. to check it in the launching process)."""
        return self._layer(index)

    def _layer(self, index: int) -> Layer:
        layer = self._layer_list[index]
        if layer is None:
            raise PipelineConfigError(f"layer {index} was dropped when this rank was "
                                      "materialized; build a new PipelineModule")
        return layer

    def stage(self, index: int) -> Stage:
        """A stage this rank holds."""
        key = str(index)
        if key not in self.stages:
            held = sorted(int(k) for k in self.stages)
            raise PipelineConfigError(f"stage {index} is not held on this rank (it holds {held})")
        return cast(Stage, self.stages[key])

    def stage_parameters(self, index: int) -> list[nn.Parameter]:
        """Trainable parameters of a stage held here."""
        return [p for p in self.stage(index).parameters() if p.requires_grad]

    def stage_of_layer(self, index: int) -> int:
        """The stage holding global layer `index`."""
        for stage in range(self.total_stages):
            if index in self.layers_of(stage):
                return stage
        raise PipelineConfigError(f"layer {index} is outside 0..{self.num_layers - 1}")

    def tied_owner_stages(self) -> dict[str, tuple[int, ...]]:
        """Tied key -> the stages holding an occurrence (known on every rank, built or not)."""
        owners: dict[str, set[int]] = {}
        for index, key in self.tied_keys.items():
            owners.setdefault(key, set()).add(self.stage_of_layer(index))
        return {key: tuple(sorted(stages)) for key, stages in sorted(owners.items())}

    def tied_parameters(self) -> dict[str, list[nn.Parameter]]:
        """Tied key -> the tied weights (`tied_weight_attr`) of its module on this rank, for
        every key with an occurrence in the stages built here."""
        return {key: self._tied_specs[key].tied_parameters(module)
                for key, module in sorted(self._tied_modules.items())}

    def named_layer_parameters(self) -> Iterator[tuple[tuple[int, str], nn.Parameter]]:
        """((global layer index, parameter name inside the layer), parameter) for every
        parameter held here: the key `pipeline.model.reference` uses, whatever the partition."""
        for index in sorted(int(key) for key in self.stages):
            for key, layer in self.stage(index).layers.items():
                for name, param in layer.named_parameters():
                    yield (int(key), name), param

    def forward(self, x: Any) -> Any:
        """Run every stage in order; only possible when this rank holds the whole model."""
        if len(self.stages) != self.total_stages:
            raise PipelineConfigError(
                f"this rank holds stages {sorted(int(k) for k in self.stages)} of "
                f"{self.total_stages}; run the model through PipelineEngine instead")
        for index in range(self.total_stages):
            x = self.stage(index)(x)
        return x

    def extra_repr(self) -> str:
        return (f"num_layers={self.num_layers}, num_stages={self.num_stages}, "
                f"chunks={self.chunks}, boundaries={self.boundaries}")


def _checked_layers(items: list[Layer], tie_shared: bool, base_seed: int | None) -> list[Layer]:
    """Refuse layers whose weights a pipeline would not train; tie shared ones when asked.

    A `LayerSpec` whose factory reaches an existing module (``LayerSpec(lambda: shared)``) is
    built here, as its owning rank would build it (same seed), so that sharing through it
    is found like sharing between listed modules."""
    probe = list(items)
    for index, layer in enumerate(items):
        if reaches_existing_weights(layer):
            with torch.random.fork_rng(devices=[]):
                if base_seed is not None:
                    torch.manual_seed(base_seed + index)
                probe[index] = build_layer(layer, index, base_seed=None)
    groups = find_shared_groups(probe)
    problems = hidden_module_problems(items)
    if not tie_shared:
        problems += shared_layer_problems(groups)
    if problems:
        raise PipelineConfigError("PipelineModule: " + "; ".join(problems))
    if not tie_shared:
        return items
    tied = tie_shared_groups(probe, groups)
    grouped = {index for group in groups for index in group.positions}
    return [tied[k] if k in grouped else layer for k, layer in enumerate(items)]
