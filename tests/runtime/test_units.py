"""Single-process tests of the runtime's parts: layers, module cut, batches, headers, shape
learning, schedule fitting, measured costs, the launcher's blame and lazy imports."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline import LayerSpec, PipelineConfigError, PipelineModule
from pipeline.model.layers import build_layer, count_parameters
from pipeline.model.reference import build_reference, reference_forward, reference_step
from pipeline.runtime.batch import (
    Layout,
    join_microbatches,
    split_microbatches,
)
from pipeline.runtime.comm import HEADER_LENGTH, decode_header, encode_header
from pipeline.runtime.schedule_setup import check_agreement, forward_schedule, resolve_schedule
from pipeline.runtime.shapes import ShapeBook
from pipeline.runtime.trace import measured_costs
from schedules import SCHEDULES, Kind, Schedule, Span, build_schedule, simulate, validate
from tests.support.pipeline_models import mlp_layers, transformer_layers


def test_layer_spec_weights_depend_only_on_the_layer_index() -> None:
    spec = LayerSpec(nn.Linear, 4, 4)
    a, b = build_layer(spec, 3, base_seed=1), build_layer(spec, 3, base_seed=1)
    c = build_layer(spec, 4, base_seed=1)
    assert torch.equal(a.weight, b.weight) and not torch.equal(a.weight, c.weight)


def test_parameter_counting_builds_on_the_meta_device() -> None:
    assert count_parameters(LayerSpec(nn.Linear, 1000, 1000)) == 1000 * 1000 + 1000
    assert count_parameters(torch.tanh) == 0


@pytest.mark.parametrize(("method", "expected"), [
    ("uniform", (0, 4, 8, 12, 16)),
    ("parameters", (0, 4, 8, 12, 16)),
    ("type:linear", (0, 4, 8, 12, 16)),
    ([0, 1, 2, 3, 16], (0, 1, 2, 3, 16)),
])
def test_partition_methods(method: object, expected: tuple[int, ...]) -> None:
    module = PipelineModule(mlp_layers(), num_stages=4, partition_method=method)  # type: ignore[arg-type]
    assert module.boundaries == expected


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_stages": 17}, "cannot fill"),
    ({"num_stages": 4, "chunks": 5}, "4 × 5 = 20"),
    ({"num_stages": 2, "partition_method": [0, 16, 16]}, "strictly increase"),
    ({"num_stages": 2, "partition_method": "type:conv"}, "matches no layer"),
    ({"num_stages": 2, "partition_method": "type:("}, "not a valid regular expression"),
    ({"num_stages": 2, "partition_method": "explicit"}, "cut indices"),
    ({"num_stages": 0}, "num_stages must be >= 1, got 0"),
    ({"num_stages": True}, "num_stages must be an int >= 1, got True"),
])
def test_module_refuses_bad_cuts(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(PipelineConfigError, match=message.replace("(", r"\(")):
        PipelineModule(mlp_layers(), **kwargs)  # type: ignore[arg-type]


def test_a_module_holding_every_stage_equals_the_reference() -> None:
    module = PipelineModule(transformer_layers(), num_stages=2, chunks=2)
    module.materialize(range(4))
    ids = torch.randint(1, 11, (3, 5))
    expected = reference_forward(build_reference(transformer_layers()), ids)
    assert torch.allclose(module(ids), expected)
    keys = [key for key, _ in module.named_layer_parameters()]
    assert keys[:2] == [(0, "embedding.weight"), (1, "layer.self_attn.in_proj_weight")]


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    x = torch.randn(6, 8)
    grads = []
    for interval in (0, 3):
        module = PipelineModule(mlp_layers(), num_stages=1, activation_checkpoint_interval=interval)
        module.materialize([0])
        module(x).square().sum().backward()
        grads.append([p.grad for p in module.parameters()])
    assert all(torch.allclose(a, b) for a, b in zip(*grads))


def test_batches_split_evenly_or_not_at_all() -> None:
    x, mask = torch.randn(12, 3), torch.ones(12, dtype=torch.bool)
    parts = split_microbatches((x, mask), 4, "inputs")
    assert len(parts) == 4 and parts[0][1].dtype == torch.bool
    joined = join_microbatches(parts)
    assert torch.equal(joined[0], x)
    with pytest.raises(PipelineConfigError, match="batch size 12 is not divisible"):
        split_microbatches(x, 5, "inputs")
    with pytest.raises(PipelineConfigError, match="same batch size"):
        split_microbatches((x, torch.ones(3)), 3, "inputs")
    with pytest.raises(TypeError, match="tensor or a tuple of tensors"):
        split_microbatches([x, "mask"], 3, "inputs")


def test_shape_headers_round_trip() -> None:
    meta = (True, (((4, 5, 8), torch.float32), ((4, 5), torch.bool), ((), torch.int64)))
    header = encode_header(meta)
    assert header.shape == (HEADER_LENGTH,) and decode_header(header) == meta
    with pytest.raises(PipelineConfigError, match="HEADER_LENGTH"):
        encode_header((True, tuple(((1, 2, 3), torch.float32) for _ in range(20))))


def test_shape_book_learns_once_and_relearns_on_change() -> None:
    book = ShapeBook()
    a = (False, (((2, 8), torch.float32),))
    b = (False, (((2, 9), torch.float32),))
    book.begin_step(1)
    assert book.sending(1, a) == a and book.receiving(2, lambda: a) == a
    book.end_step()
    book.begin_step(1)
    assert book.sending(1, a) is None and book.receiving(2, lambda: b) == a
    book.end_step()
    book.begin_step(2)  # the batch changed: headers again, and an edge that varies stays dynamic
    book.sending(1, a)
    book.sending(1, b)
    book.end_step()
    book.begin_step(2)
    assert book.sending(1, b) == b and 1 in book.dynamic


@pytest.mark.parametrize(("schedule", "chunks", "message"), [
    ("gpipe", 2, r"takes chunks in 1, got 2; use 'interleaved'.*PipelineModule\(..., chunks=\)"),
    ("zigzag", 1, "unknown schedule 'zigzag'"),
])
def test_schedules_that_do_not_fit_are_refused(schedule: str, chunks: int, message: str) -> None:
    module = PipelineModule(mlp_layers(), num_stages=2, chunks=chunks)
    with pytest.raises(PipelineConfigError, match=message):
        resolve_schedule(schedule, module, 4)


def test_a_schedule_object_must_match_the_module() -> None:
    module = PipelineModule(mlp_layers(), num_stages=4)
    with pytest.raises(PipelineConfigError, match="chunks=2"):
        resolve_schedule(build_schedule("interleaved", 4, 4, 2), module, None)
    with pytest.raises(PipelineConfigError, match="num_microbatches=3 but"):
        resolve_schedule(build_schedule("1f1b", 4, 4), module, 3)


def test_a_broken_schedule_is_refused_with_the_validator_grid() -> None:
    broken = Schedule.from_text("rank 0: 0F0 0B0\nrank 1: 1B0 1F0")
    with pytest.raises(PipelineConfigError, match="refused") as caught:
        resolve_schedule(broken, PipelineModule(mlp_layers(), num_stages=2), None)
    assert "rank 1" in str(caught.value) and "[" in str(caught.value)


@pytest.mark.parametrize("name", [n for n in SCHEDULES if n != "forward-only"])
def test_forward_schedules_keep_the_placement_and_validate(name: str) -> None:
    chunks = SCHEDULES[name].default_chunks
    schedule = forward_schedule(build_schedule(name, 4, 8, chunks))
    validate(schedule)
    assert not schedule.has_backward and schedule.placement == build_schedule(
        name, 4, 8, chunks).placement


def test_disagreement_names_the_field_and_ranks() -> None:
    with pytest.raises(PipelineConfigError, match="rank 1 has num_microbatches=4 where rank 0"):
        check_agreement([{"num_microbatches": 8}, {"num_microbatches": 4}], [0, 1])


def test_measured_costs_feed_the_simulator() -> None:
    spans = [Span(0, Kind.F, 0, 0, 0.0, 1.0), Span(0, Kind.SEND_F, 0, 0, 1.0, 1.1),
             Span(1, Kind.RECV_F, 1, 0, 0.0, 1.6), Span(1, Kind.F, 1, 0, 1.6, 3.6),
             Span(1, Kind.B, 1, 0, 3.6, 7.6), Span(0, Kind.B, 0, 0, 7.8, 9.8)]
    costs = measured_costs(spans)
    assert costs.forward == {0: 1.0, 1: 2.0} and costs.latency == pytest.approx(0.5)
    model = costs.cost_model(2)
    assert model.forward == pytest.approx([1.1, 2.0]) and model.comm == pytest.approx(0.5)
    assert simulate(build_schedule("gpipe", 2, 1), model).end.max() > 0


def test_reference_step_matches_a_hand_written_step() -> None:
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    result = reference_step(mlp_layers(), x, y, loss_fn=F.mse_loss,
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5))
    model = build_reference(mlp_layers())
    F.mse_loss(reference_forward(model, x), y).backward()
    assert torch.allclose(model[0].weight.grad, result.grads[(0, "weight")])
    assert torch.allclose(model[0].weight - 0.5 * model[0].weight.grad,
                          result.params[(0, "weight")])


def test_importing_pipeline_does_not_import_torch() -> None:
    code = ("import sys, pipeline, pipeline.cli; assert 'torch' not in sys.modules; "
            "print(sorted(pipeline.__all__)[:3])")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=".", capture_output=True)


def test_layouts_tell_tuples_and_shapes_apart() -> None:
    x = torch.zeros(2, 3)
    assert Layout.of(x) != Layout.of((x,)) and Layout.of(x) != Layout.of(torch.zeros(2, 4))
