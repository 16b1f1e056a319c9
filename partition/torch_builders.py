"""Model graphs from torch modules: a profiled chain of layers, or a profiled torch.fx DAG."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from partition.builders import chain_graph
from partition.graph import LayerCost, ModelGraph
from partition.layertypes import layer_type_name
from partition.profiler import Measurement, measure, parameter_bytes, profile_sequence, tensor_bytes

__all__ = ["graph_from_fx", "graph_from_layers"]

# torch is imported inside the functions: `import partition` must work without it.


@dataclass(frozen=True)
class _Profile:
    """Per fx node: its measurement (call nodes) and its output bytes (every node)."""

    measurements: dict[str, Measurement]
    output_bytes: dict[str, int]


def _layer_names(layers: Any, count: int) -> list[str]:
    """Child names of an nn.Sequential (unique by construction), else ``layer<i>``."""
    named_children = getattr(layers, "named_children", None)
    if callable(named_children):
        names = [name for name, _ in named_children()]
        if len(names) == count:
            return names
    return [f"layer{index}" for index in range(count)]


def graph_from_layers(
    layers: Sequence[Any],
    sample_input: Any,
    *,
    repeats: int = 5,
    warmup: int = 1,
    bandwidth: float | None = None,
) -> ModelGraph:
    """Profile a chain of layers (an ``nn.Sequential`` or a list of modules or callables)
    on ``sample_input`` and return it as a chain graph.

    Each layer runs on the previous layer's output on the sample's device; forward and
    backward are timed separately (median of ``repeats`` after ``warmup`` runs), the
    activation is the output's bytes, params the layer's parameter bytes. The edge i -> i+1
    carries layer i's output. Use a microbatch-sized sample: costs are per microbatch.
    """
    sequence = list(layers)
    names = _layer_names(layers, len(sequence))
    profiled = profile_sequence(sequence, sample_input, names=names, repeats=repeats, warmup=warmup)
    costs = [
        LayerCost(
            name=name,
            forward=measurement.forward,
            backward=measurement.backward,
            params=float(params),
            activation=float(measurement.output_bytes),
            type_name=layer_type_name(layer),
        )
        for name, layer, (measurement, params) in zip(names, sequence, profiled, strict=True)
    ]
    return chain_graph(costs, bandwidth=bandwidth)


def graph_from_fx(
    module: Any,
    sample_input: Any,
    *,
    repeats: int = 5,
    warmup: int = 1,
    bandwidth: float | None = None,
) -> ModelGraph:
    """Trace ``module`` with torch.fx (or take a GraphModule), profile every node on
    ``sample_input`` (a tensor or a tuple of positional inputs), and return the DAG.

    Layers are the fx nodes in graph order (topological): inputs (placeholders, zero cost,
    so shipping an input to a later stage counts) and every call. Parameters read with
    ``get_attr`` are charged to the node that uses them; the output node is dropped. An
    edge u -> v carries u's output bytes, so a skip connection across a cut is paid by both
    stages it joins.
    """
    import torch.fx

    graph_module = (
        module if isinstance(module, torch.fx.GraphModule) else torch.fx.symbolic_trace(module)
    )
    inputs = sample_input if isinstance(sample_input, tuple) else (sample_input,)
    profile = _profile_nodes(graph_module, inputs, repeats=repeats, warmup=warmup)

    nodes = [node for node in graph_module.graph.nodes if node.op not in ("get_attr", "output")]
    position = {node: index for index, node in enumerate(nodes)}
    layers = [_node_cost(graph_module, node, profile) for node in nodes]
    edges = [
        (position[source], position[node], float(profile.output_bytes[source.name]))
        for node in nodes
        for source in node.all_input_nodes
        if source in position
    ]
    return ModelGraph(layers, edges, bandwidth=bandwidth)


def _node_cost(graph_module: Any, node: Any, profile: _Profile) -> LayerCost:
    """One fx node's `LayerCost` from the interpreter's measurements."""
    activation = float(profile.output_bytes[node.name])
    if node.op == "placeholder":
        return LayerCost(node.name, activation=activation, type_name="placeholder")
    params = 0.0
    if node.op == "call_module":
        submodule = graph_module.get_submodule(node.target)
        params = float(parameter_bytes(submodule))
        type_name = type(submodule).__name__
    elif node.op == "call_method":
        type_name = str(node.target)
    else:
        type_name = layer_type_name(node.target)
    # Tensors fetched with get_attr (parameters used directly) belong to their user.
    for source in node.all_input_nodes:
        if source.op == "get_attr":
            params += float(profile.output_bytes[source.name])
    measurement: Measurement = profile.measurements[node.name]
    return LayerCost(
        node.name,
        forward=measurement.forward,
        backward=measurement.backward,
        params=params,
        activation=activation,
        type_name=type_name,
    )


def _profile_nodes(
    graph_module: Any, inputs: tuple[Any, ...], *, repeats: int, warmup: int
) -> _Profile:
    """Run the GraphModule once, measuring every call node on its real inputs."""
    import torch.fx

    profile = _Profile({}, {})

    class ProfilingInterpreter(torch.fx.Interpreter):
        def run_node(self, node: torch.fx.Node) -> Any:
            if node.op in ("placeholder", "get_attr", "output"):
                result = super().run_node(node)
                profile.output_bytes[node.name] = tensor_bytes(result)
                return result
            args, kwargs = self.fetch_args_kwargs_from_env(node)
            handler = getattr(self, node.op)
            submodule = (
                self.module.get_submodule(str(node.target)) if node.op == "call_module" else None
            )
            measurement = measure(
                lambda inputs: handler(node.target, inputs[0], inputs[1]),
                (tuple(args), dict(kwargs)),
                name=node.name,
                layer=submodule,
                repeats=repeats,
                warmup=warmup,
            )
            profile.measurements[node.name] = measurement
            profile.output_bytes[node.name] = measurement.output_bytes
            return measurement.output

    ProfilingInterpreter(graph_module).run(*inputs)
    return profile
