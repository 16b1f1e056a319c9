"""Imports flow one way: between the top-level packages, and between `pipeline/`'s rooms."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]

# A package may import only what stands below it. `pipeline` may use all of
# `schedules`, `partition` and `viz`; `viz` draws what the two pure packages produce.
TOP_LEVEL: dict[str, frozenset[str]] = {
    "schedules": frozenset(),
    "partition": frozenset(),
    "viz": frozenset({"schedules", "partition"}),
    "pipeline": frozenset({"schedules", "partition", "viz"}),
}
# pipeline's rooms, each importing only those after it: cli -> jobs -> demo -> rehearsal ->
# planner -> interop -> runtime -> moe -> checkpoint -> model -> parallel -> launcher ->
# supervision -> device -> the shared leaves (pipeline/*.py: errors, limits, files,
# recompute_region; why each serves every room: pipeline/__init__.py).
ROOMS = ("", "device", "supervision", "launcher", "parallel", "model", "checkpoint", "moe",
         "runtime", "interop", "planner", "rehearsal", "demo", "jobs", "cli")


def _imports(path: Path, *, runtime_only: bool = False) -> list[str]:
    """Every module `path` imports; with `runtime_only`, less those under
    `if TYPE_CHECKING:`, which never run (naming a type there is how a module refers to its
    caller's type without a circle)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    hidden = {id(inner) for node in ast.walk(tree) if _is_type_checking_block(node)
              for stmt in node.body for inner in ast.walk(stmt)} if runtime_only else set()
    names: list[str] = []
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
        elif _is_import_module_call(node):  # importlib.import_module("a.b") imports a.b too
            names.append(node.args[0].value)  # type: ignore[attr-defined]
    return names


def _is_import_module_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call) or not node.args:
        return False
    func, first = node.func, node.args[0]
    named = (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id == "import_module")
    return named and isinstance(first, ast.Constant) and isinstance(first.value, str)


def _is_type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in ROOMS else ""


def _sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(TOP_LEVEL))
def test_top_level_packages_import_only_what_stands_below(package: str) -> None:
    bad = []
    for path in _sources(package):
        for name in _imports(path):
            top = name.split(".")[0]
            if top in TOP_LEVEL and top != package and top not in TOP_LEVEL[package]:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_schedules_import_no_torch() -> None:
    bad = [f"{path.relative_to(ROOT)} imports {name}" for path in _sources("schedules")
           for name in _imports(path) if name.split(".")[0] == "torch"]
    assert not bad, "\n".join(bad)


def test_pipeline_rooms_import_one_way() -> None:
    bad = []
    for path in _sources("pipeline"):
        relative = path.relative_to(ROOT / "pipeline")
        here = relative.parts[0] if len(relative.parts) > 1 else ""
        if here == "" and relative.name == "__init__.py":
            continue  # the package facade re-exports every room lazily
        for name in _imports(path):
            if not name.startswith("pipeline."):
                continue
            there = _room(name) if name.count(".") >= 1 else ""
            if name.split(".")[1] in ROOMS:
                there = name.split(".")[1]
            if ROOMS.index(there) > ROOMS.index(here):
                bad.append(f"pipeline/{relative} ({here or 'root'}) imports {name} ({there})")
    assert not bad, "\n".join(bad)


def test_public_names_are_not_shadowed_by_rooms() -> None:
    # importing a room binds it as an attribute of `pipeline`: no room may share a public
    # name (a `pipeline/launch/` folder would turn `from pipeline import launch` into a module)
    import importlib

    import pipeline

    for room in ROOMS[1:]:
        importlib.import_module(f"pipeline.{room}")
    clashes = sorted(set(ROOMS) & set(pipeline.__all__))
    assert not clashes, f"rooms named like public names: {clashes}"
    assert callable(pipeline.launch)
    from pipeline import PipelineEngine, launch
    assert launch.__module__ == "pipeline.launcher.processes"
    assert PipelineEngine.__module__ == "pipeline.runtime.engine"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SCRIPT_DIRS = frozenset({"benchmarks"})
"""Folders of scripts run with their own folder on sys.path: `import bench_common` there is
`benchmarks.bench_common`."""


def _import_graph(*packages: str) -> nx.DiGraph:
    """Modules of `packages` and which import which at run time (lazy imports inside
    functions and `importlib.import_module("...")` too: they close a circle as surely at
    run time)."""
    modules = {_module_name(path): path for package in packages for path in _sources(package)}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        top = name.split(".")[0]
        for imported in _imports(path, runtime_only=True):
            candidates = [imported, f"{top}.{imported}"] if top in SCRIPT_DIRS else [imported]
            for candidate in candidates:
                # `from a.b import c` names a.b.c: the module c if there is one, else a.b
                target = candidate if candidate in modules else candidate.rpartition(".")[0]
                if target in modules:
                    if target != name and not name.startswith(target + "."):
                        graph.add_edge(name, target)
                    break
    return graph


def _is_facade(source: str, target: str) -> bool:
    """A package's `__init__` importing its own modules: its facade, not a circle."""
    return source.count(".") < target.count(".") and target.startswith(source + ".")


def _room_cycles(graph: nx.DiGraph) -> list[list[str]]:
    """Import circles between the files of one room."""
    inside = nx.DiGraph()
    for source, target in graph.edges:
        if _room(source) == _room(target) and not _is_facade(source, target):
            inside.add_edge(source, target)
    return [cycle for cycle in nx.simple_cycles(inside)]


def _cycles(graph: nx.DiGraph) -> list[list[str]]:
    """Import circles anywhere in `graph`, across rooms and packages: one per strongly
    connected group of modules, each a circle through it."""
    edges = nx.DiGraph([(s, t) for s, t in graph.edges if not _is_facade(s, t)])
    return [nx.find_cycle(edges.subgraph(group), next(iter(group)))
            for group in nx.strongly_connected_components(edges) if len(group) > 1]


def test_files_inside_a_room_import_without_circles() -> None:
    cycles = _room_cycles(_import_graph("pipeline"))
    assert not cycles, "\n".join(" -> ".join([*cycle, cycle[0]]) for cycle in cycles)


def test_typing_only_imports_close_no_circle(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nimport a.b\nif TYPE_CHECKING:\n"
                      "    from a.c import D\n")
    assert _imports(source, runtime_only=True) == ["typing", "typing.TYPE_CHECKING", "a.b"]


def test_the_circle_check_finds_a_planted_circle() -> None:
    # the planner's calibrate -> cluster -> calibrate circle (issue 21, defect 6), planted back
    graph = _import_graph("pipeline")
    graph.add_edge("pipeline.planner.cluster", "pipeline.planner.calibrate")
    assert ["pipeline.planner.calibrate", "pipeline.planner.cluster"] in [
        sorted(cycle) for cycle in _room_cycles(graph)]


def _format(cycles: list[list[tuple[str, str]]]) -> str:
    return "\n".join(" -> ".join([*(source for source, _ in cycle), cycle[0][0]])
                     for cycle in cycles)


def test_pipeline_and_benchmarks_import_without_circles() -> None:
    # across rooms and packages, through lazy imports and import_module("...") too (issue
    # 47: runtime engine -> interpreter -> loss_normalization -> engine, interop hf_layers
    # <-> hf_moe, benchmarks bench_schedules <-> bench_references)
    cycles = _cycles(_import_graph("pipeline", "benchmarks"))
    assert not cycles, _format(cycles)


@pytest.mark.parametrize("planted", [
    # across rooms: a runtime module importing the interop module that imports it
    ("pipeline.runtime.loss_normalization", "pipeline.interop.deepspeed_compat"),
    # within benchmarks, as scripts import each other (`from bench_schedules import ...`)
    ("benchmarks.torch_stand_ins", "benchmarks.bench_lowering"),
])
def test_the_whole_circle_check_finds_a_planted_circle(planted: tuple[str, str]) -> None:
    graph = _import_graph("pipeline", "benchmarks")
    assert nx.has_path(graph, planted[1], planted[0]), "the plant must close a circle"
    graph.add_edge(*planted)
    cycles = _cycles(graph)
    assert any(planted in cycle for cycle in cycles), _format(cycles)


def test_import_module_calls_and_script_imports_are_edges(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("import importlib\n\ndef f():\n    importlib.import_module('a.b')\n"
                      "    importlib.import_module(name)\n")
    assert _imports(source) == ["importlib", "a.b"]
    graph = _import_graph("pipeline", "benchmarks")
    assert graph.has_edge("pipeline.interop.hf_layers", "pipeline.interop.hf_moe_families")
    assert graph.has_edge("benchmarks.bench_lowering", "benchmarks.torch_stand_ins")
