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
    LayerSpec,
    ParallelConfig,
    PipelineConfigError,
    PipelineModule,
    TiedLayerSpec,
    Topology,
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
    for expected in ("data_parallel must be an int >= 1, got 0",
                     "tensor_parallel must be an int >= 1, got True",
                     "precision must be one of ('fp32', 'bf16', 'fp16'), got 'fp8'",
                     "gradient_clipping must be a finite number > 0", "bucket_mb must be > 0",
                     "loss_scale_window must be an int >= 1"):
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


def test_zero_2_and_3_are_refused_with_the_reason() -> None:
    with pytest.raises(PipelineConfigError, match=r"zero_stage=2 cannot be combined with "
                       r"pipeline_parallel=2: .* reduce-scatter after every microbatch"):
        resolve_topology(4, 2, None, ParallelConfig(zero_stage=2))
    with pytest.raises(PipelineConfigError, match="zero_stage=3 is not implemented; use "
                       "zero_stage=1"):
        resolve_topology(2, 1, None, ParallelConfig(zero_stage=3))


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


def test_new_public_names_resolve() -> None:
    for name in ("TiedLayerSpec", "ParallelConfig", "ProcessGroups", "ShardedOptimizer",
                 "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
                 "ParallelTransformerBlock", "parallel_lm_logits", "DynamicLossScaler",
                 "current_process_groups", "ZeroStageError", "OptimizerStep"):
        assert name in pipeline.__all__ and getattr(pipeline, name) is not None
