"""Methods, their typed errors, the result type and partition_layers on plain objects (no torch)."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from partition import (
    InfeasibleMemoryError,
    InvalidBoundariesError,
    InvalidOptionError,
    LayerCost,
    MemoryCapExceededError,
    Method,
    ModelGraph,
    NoMatchingLayerError,
    Partition,
    ScheduleMemory,
    TooManyStagesError,
    UnknownMethodError,
    chain_graph,
    parse_method,
    partition_graph,
    partition_layers,
    partition_weights,
)

__all__: list[str] = []


def transformer_graph() -> ModelGraph:
    layers = [
        LayerCost("embed", forward=1, backward=1, params=4000, activation=10, type_name="Embedding")
    ]
    layers += [
        LayerCost(f"block{i}", forward=2, backward=4, params=1000, activation=10, type_name="Block")
        for i in range(6)
    ]
    layers.append(
        LayerCost("head", forward=3, backward=6, params=4000, activation=40, type_name="Linear")
    )
    return chain_graph(layers)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("uniform", (Method.UNIFORM, None)),
        ("Parameters", (Method.PARAMETERS, None)),
        ("type:Linear|Attn", (Method.TYPE, "Linear|Attn")),
        ("balanced", (Method.BALANCED, None)),
        ("explicit", (Method.EXPLICIT, None)),
    ],
)
def test_parse_method(text: str, expected: tuple[Method, str | None]) -> None:
    assert parse_method(text) == expected


@pytest.mark.parametrize("text", ["profile", "type:", "uniform:3", ""])
def test_parse_method_rejects_and_lists_allowed_values(text: str) -> None:
    with pytest.raises(UnknownMethodError, match="type:<regex>"):
        parse_method(text)


def test_uniform_gives_the_extra_layers_to_the_first_stages() -> None:
    assert partition_layers(list(range(10)), 4, "uniform") == (0, 3, 6, 8, 10)


def test_more_stages_than_layers() -> None:
    with pytest.raises(TooManyStagesError, match="cannot split 3 layers into 4"):
        partition_weights([1.0, 2.0, 3.0], 4)


def test_min_spread_is_not_min_max_deepspeed_example() -> None:
    """DeepSpeed's partition_balanced minimises max - min and returns (0, 2, 3, 4) here,
    a bottleneck of 10; the min-max optimum is 9."""
    weights = [1.0, 9.0, 2.0, 7.0]
    cuts = partition_weights(weights, 3)
    assert max(sum(weights[a:b]) for a, b in itertools.pairwise(cuts)) == 9.0


def test_type_method_balances_matching_layers() -> None:
    result = partition_graph(transformer_graph(), 3, method=Method.TYPE, type_pattern="block")
    blocks = [
        sum(1 for i in result.layers_of(k) if result.layer_names[i].startswith("block"))
        for k in range(3)
    ]
    assert blocks == [2, 2, 2]


def test_type_pattern_matching_nothing_lists_the_types() -> None:
    with pytest.raises(NoMatchingLayerError, match=r"'Attn' matches no layer.*Embedding, Block"):
        partition_graph(transformer_graph(), 2, method=Method.TYPE, type_pattern="Attn")


def test_parameters_method_balances_parameter_bytes() -> None:
    result = partition_graph(transformer_graph(), 2, method="parameters")
    assert result.boundaries == (0, 4, 8)


def test_explicit_boundaries_are_validated() -> None:
    graph = transformer_graph()
    with pytest.raises(InvalidBoundariesError, match="stages \\[1\\] would be empty"):
        partition_graph(graph, 3, method=Method.EXPLICIT, boundaries=(0, 4, 4, 8))
    with pytest.raises(InvalidBoundariesError, match="last 8"):
        partition_graph(graph, 2, method=Method.EXPLICIT, boundaries=(0, 4, 7))
    with pytest.raises(InvalidOptionError, match="only apply to method EXPLICIT"):
        partition_graph(graph, 2, boundaries=(0, 4, 8))


def test_options_are_checked_together() -> None:
    with pytest.raises(InvalidOptionError) as raised:
        partition_graph(transformer_graph(), 2, speeds=[1.0], memory_cap=-5, bandwidth=math.nan)
    message = str(raised.value)
    assert "speeds has 1 entries" in message and "memory_cap=-5" in message
    assert "bandwidth=nan" in message


def test_infeasible_cap_names_the_smallest_cap_that_works() -> None:
    graph = transformer_graph()
    with pytest.raises(InfeasibleMemoryError) as raised:
        partition_graph(graph, 2, memory_cap=1000.0)
    smallest = raised.value.minimum_cap
    assert "smallest cap" in str(raised.value) and smallest > 1000.0
    fitted = partition_graph(graph, 2, memory_cap=smallest)
    assert max(fitted.memory) <= smallest
    with pytest.raises(InfeasibleMemoryError):
        partition_graph(graph, 2, memory_cap=smallest * (1 - 1e-9))


def test_1f1b_memory_holds_fewer_microbatches_on_later_stages() -> None:
    graph = chain_graph([LayerCost(f"l{i}", forward=1, activation=100) for i in range(4)])
    result = partition_graph(graph, 4, optimizer_bytes_per_param_byte=0.0)
    assert result.memory == (400.0, 300.0, 200.0, 100.0)
    gpipe = partition_graph(graph, 4, schedule_memory=ScheduleMemory.GPIPE, num_microbatches=8)
    assert gpipe.memory == (800.0,) * 4
    few = partition_graph(graph, 4, num_microbatches=2)
    assert few.memory == (200.0, 200.0, 200.0, 100.0)


def test_fixed_methods_report_a_stage_over_the_cap() -> None:
    with pytest.raises(MemoryCapExceededError, match="stage 0 needs"):
        partition_graph(transformer_graph(), 2, method=Method.UNIFORM, memory_cap=1000.0)


def test_slower_stage_gets_less_work() -> None:
    graph = chain_graph([1.0] * 12)
    result = partition_graph(graph, 3, speeds=[1.0, 0.5, 1.0])
    assert result.boundaries == (0, 5, 7, 12)
    assert result.compute == (5.0, 4.0, 5.0)


def test_partition_result_is_plain_data() -> None:
    result = partition_graph(transformer_graph(), 3)
    assert result.stage_of(0) == 0 and result.stage_of(7) == 2
    assert result.imbalance == pytest.approx(result.bottleneck / (sum(result.cost) / 3))
    data = json.loads(json.dumps(result.to_dict()))
    assert data["boundaries"] == list(result.boundaries)
    assert data["bottleneck"] == result.bottleneck
    assert [stage["cost"] for stage in data["stages"]] == list(result.cost)
    table = str(result)
    assert "bottleneck" in table and "embed .. " in table and len(table.splitlines()) == 6


def test_partition_rejects_inconsistent_fields() -> None:
    with pytest.raises(InvalidOptionError, match="need 2 entries"):
        Partition(boundaries=(0, 1, 2), compute=(1.0,), comm=(0.0,), memory=(0.0,))


class Spec:
    """A lazy layer spec the runtime might pass: only its typename is known."""

    def __init__(self, typename: type) -> None:
        self.typename = typename


class Attention:
    pass


class MLP:
    pass


def relu(x: float) -> float:
    return max(x, 0.0)


def test_partition_layers_on_specs_callables_and_weights() -> None:
    layers = [Spec(Attention), Spec(MLP), relu, Spec(Attention), Spec(MLP), relu]
    assert partition_layers(layers, 2, "type:attention") == (0, 3, 6)
    assert partition_layers(layers, 3, "parameters", weights=[5, 1, 1, 5, 1, 1]) == (0, 2, 4, 6)
    assert partition_layers(layers, 2, "balanced", weights=[1, 1, 1, 1, 1, 5]) == (0, 5, 6)
    # Without costs: parameter count + 1 per layer, all zero parameters here -> uniform.
    assert partition_layers(layers, 3) == (0, 2, 4, 6)
    assert partition_layers(layers, 2, "explicit", boundaries=[0, 1, 6]) == (0, 1, 6)
    with pytest.raises(InvalidOptionError, match="weights has 2 entries for 6 layers"):
        partition_layers(layers, 2, weights=[1, 2])
    with pytest.raises(NoMatchingLayerError, match="Attention, MLP, relu"):
        partition_layers(layers, 2, "type:conv")
