"""3D setup without processes: config validation, the grid, how layers get their tp group, tied
specs, and where the schedule puts the once-per-batch gradient reduction."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from torch import nn

import pipeline
from pipeline import (
    ColumnParallelLinear,
    EngineConfig,
    LayerSpec,
    ParallelConfig,
    PipelineConfigError,
    PipelineModule,
    TiedLayerSpec,
    Topology,
    ZeroStage,
    ZeroStageError,
)
from pipeline.model.build_context import building_with, call_with_group, current_process_groups
from pipeline.model.layers import TiedLayer, count_parameters
from pipeline.model.reference import build_reference, reference_step
from pipeline.runtime.parallel_setup import resolve_topology
from schedules import Kind, build_schedule
from tests.support.engine3d_models import tied_layers


def test_parallel_config_lists_every_problem_at_once() -> None:
    with pytest.raises(PipelineConfigError) as caught:
        ParallelConfig(data_parallel=0, tensor_parallel=True, precision="fp8",
                       gradient_clipping=0.0, bucket_mb=-1, loss_scale_window=0)
    message = str(caught.value)
    for expected in ("data_parallel must be >= 1, got 0",
                     "tensor_parallel must be an int >= 1, got True",
                     "precision must be one of ('fp32', 'bf16', 'fp16'), got 'fp8'",
                     "gradient_clipping must be a finite number > 0",
                     "bucket_mb must be a finite number > 0",
                     "loss_scale_window must be >= 1, got 0"):
        assert expected in message


def test_the_grid_comes_from_world_size_stages_and_sizes() -> None:
    assert resolve_topology(8, 2, None, ParallelConfig(tensor_parallel=2)) == Topology(2, 2, 2)
    assert resolve_topology(4, 2, None, ParallelConfig()) == Topology(2, 2, 1)
    with pytest.raises(PipelineConfigError, match=r"world size 4 does not match "
                       r"pipeline_parallel=2 × data_parallel=2 × tensor_parallel=2 = 8; "
                       r"launch 8 processes"):
        resolve_topology(4, 2, None, ParallelConfig(data_parallel=2, tensor_parallel=2))
    with pytest.raises(PipelineConfigError, match="not divisible by num_stages=2 × "
                       "tensor_parallel=2"):
        resolve_topology(6, 2, None, ParallelConfig(tensor_parallel=2))
    with pytest.raises(PipelineConfigError, match="data_parallel=4 but the topology has 2"):
        resolve_topology(4, 2, Topology(2, 2), ParallelConfig(data_parallel=4))


@pytest.mark.parametrize("stage", [2, 3, ZeroStage.GRADIENTS, ZeroStage.PARAMETERS])
def test_zero_2_and_3_are_accepted_inside_pipeline_stages(stage: int) -> None:
    # refused before issue 45; tests/parallel/test_zero_stages*.py run them against HF
    assert ParallelConfig(zero_stage=stage).zero_stage == int(stage)


@pytest.mark.parametrize("stage", [-1, 4, True, "1", 1.0])
def test_unknown_zero_stage_is_refused(stage: object) -> None:
    with pytest.raises(ZeroStageError, match="zero_stage must be a ZeroStage"):
        ParallelConfig(zero_stage=stage)  # type: ignore[arg-type]


def test_zero_stage_ints_become_the_enum() -> None:
    assert ParallelConfig(zero_stage=1).zero_stage is ZeroStage.OPTIMIZER_STATE  # type: ignore[arg-type]
    assert ParallelConfig().zero_stage is ZeroStage.DISABLED
    assert EngineConfig.from_options(zero_stage=1).parallel.zero_stage is \
        ZeroStage.OPTIMIZER_STATE


def test_initial_loss_scale_of_a_wrong_type_is_in_the_collected_message() -> None:
    # regression: initial_loss_scale="x" raised a bare TypeError ('>' between str and int)
    with pytest.raises(PipelineConfigError, match=r"initial_loss_scale must be a finite number "
                       r"> 0, got 'x'.*loss_scale_window must be >= 1"):
        ParallelConfig(initial_loss_scale="x", loss_scale_window=0)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["gradient_clipping", "bucket_mb", "initial_loss_scale"])
def test_true_is_not_a_number_for_gradient_clipping_and_bucket_mb(name: str) -> None:
    with pytest.raises(PipelineConfigError, match=f"{name} must be a finite number > 0.*got True"):
        ParallelConfig(**{name: True})


def test_engine_options_are_checked_once_with_a_hint_for_misspellings() -> None:
    with pytest.raises(PipelineConfigError, match=r"unknown option\(s\) 'zero_stag' \(did you "
                       r"mean 'zero_stage'\?\)"):
        EngineConfig.from_options(zero_stag=1)
    with pytest.raises(PipelineConfigError, match=r"timeout must be a number of seconds in "
                       r"\(0, 2.592e\+06\] \(30 days\), got True; dynamic_shapes must be True "
                       r"or False, got 1"):
        EngineConfig(timeout=True, dynamic_shapes=1)  # type: ignore[arg-type]
    config = EngineConfig.from_options(schedule="gpipe", num_microbatches=4, data_parallel=2,
                                       precision="bf16", timeout=30)
    assert config == EngineConfig(schedule="gpipe", num_microbatches=4, timeout=30,
                                  parallel=ParallelConfig(data_parallel=2, precision="bf16"))


def _takes_group(size: int, group: Any = "unset") -> tuple[int, Any]:
    return size, group


def test_a_layer_factory_gets_the_tensor_parallel_group_at_build_time() -> None:
    assert call_with_group(_takes_group, (3,), {}) == (3, None)  # outside materialize: tp = 1
    fake = cast(Any, SimpleNamespace(tp_group="the tp group"))
    with building_with(fake):
        assert current_process_groups() is fake
        assert call_with_group(_takes_group, (3,), {}) == (3, "the tp group")
        assert call_with_group(_takes_group, (3, "mine"), {}) == (3, "mine")  # given wins
        assert call_with_group(_takes_group, (3,), {"group": None}) == (3, None)
        conv = LayerSpec(nn.Conv2d, 4, 4, 3, groups=2).build()  # `groups` is not `group`
        assert isinstance(conv, nn.Conv2d) and conv.groups == 2
    assert current_process_groups() is None
    # parameter counting (for the partition) builds the full layer: 4 · 8 + 8
    assert count_parameters(LayerSpec(ColumnParallelLinear, 4, 8)) == 40
    full = LayerSpec(ColumnParallelLinear, 4, 8).build()
    assert isinstance(full, ColumnParallelLinear) and full.weight.shape == (8, 4)


def test_tied_specs_of_one_key_must_build_the_same_module() -> None:
    layers = [TiedLayerSpec("embed", nn.Embedding, 10, 4), LayerSpec(nn.Linear, 4, 4),
              TiedLayerSpec("embed", nn.Embedding, 12, 4)]
    with pytest.raises(PipelineConfigError, match=r"only forward_fn may differ.*layer 2 builds "
                       r"TiedLayerSpec\('embed', Embedding, args=\(12, 4\)"):
        PipelineModule(layers, num_stages=1)
    module = PipelineModule(tied_layers(), num_stages=2)
    assert module.tied_keys == {0: "embed", 5: "embed"}
    assert module.tied_owner_stages() == {"embed": (0, 1)}


def test_reference_shares_a_tied_module_so_its_gradient_is_the_sum_of_its_uses() -> None:
    model = build_reference(tied_layers())
    first, last = model[0], model[5]
    assert isinstance(first, TiedLayer) and isinstance(last, TiedLayer)
    assert first.module is last.module
    ids = torch.randint(0, 12, (4, 5))
    result = reference_step(model, ids, ids, loss_fn=lambda out, target: nn.functional
                            .cross_entropy(out.reshape(-1, 12), target.reshape(-1)))
    assert torch.equal(result.grads[(0, "module.weight")], result.grads[(5, "module.weight")])
    assert len([p for p in model.parameters()]) == 5  # the embedding counted once


def test_gradients_are_reduced_once_per_stage_and_batch_overlapping_other_stages() -> None:
    schedule = build_schedule("interleaved", 2, 4, 2)  # rank 0 holds stages 0 and 2
    stream = schedule.streams[0]
    reduces = [k for k, op in enumerate(stream) if op.kind is Kind.REDUCE_GRAD]
    assert [stream[k].stage for k in reduces] == [2, 0]  # once per stage, not per microbatch
    last_backward_of_0 = max(k for k, op in enumerate(stream)
                             if op.kind is Kind.B and op.stage == 0)
    assert reduces[0] < last_backward_of_0  # stage 2's reduction runs while stage 0 computes


def test_every_public_name_is_its_room_s_own() -> None:
    # `pipeline.X` is the object its room defines and exports (not a stale lazy entry, not a
    # re-export of something else under the same name)
    import importlib

    from pipeline import _LAZY

    for name, module_name in _LAZY.items():
        room = importlib.import_module(module_name)
        assert name in room.__all__, f"{module_name}.__all__ lacks {name}"
        value = getattr(pipeline, name)
        assert value is getattr(room, name)
        defined_in = getattr(value, "__module__", module_name)
        if defined_in == "typing":  # a type alias (Precision = Literal[...]) keeps typing's
            continue
        assert defined_in == module_name, f"pipeline.{name} is defined in {defined_in}"
