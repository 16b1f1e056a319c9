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
# pipeline's rooms, lowest first: cli -> jobs -> demo -> rehearsal -> planner -> interop ->
# runtime -> moe -> checkpoint -> model -> parallel -> launcher -> supervision -> the shared leaves
# (pipeline/*.py: errors, device, limits, files).
ROOMS = ("", "supervision", "launcher", "parallel", "model", "checkpoint", "moe", "runtime",
         "interop", "planner", "rehearsal", "demo", "jobs", "cli")


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
    return names


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


def _import_graph(package: str) -> nx.DiGraph:
    """Modules of `package` and which import which at run time (lazy imports inside
    functions too: they close a circle as surely at run time)."""
    modules = {_module_name(path): path for path in _sources(package)}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        for imported in _imports(path, runtime_only=True):
            # `from a.b import c` names a.b.c: the module c if there is one, else a.b
            target = imported if imported in modules else imported.rpartition(".")[0]
            if target in modules and target != name and not name.startswith(target + "."):
                graph.add_edge(name, target)
    return graph


def _room_cycles(graph: nx.DiGraph) -> list[list[str]]:
    """Import circles between the files of one room (a package's `__init__` re-exporting
    its own modules is its facade, not a circle)."""
    inside = nx.DiGraph()
    for source, target in graph.edges:
        facade = source.count(".") < target.count(".") and target.startswith(source + ".")
        if _room(source) == _room(target) and not facade:
            inside.add_edge(source, target)
    return [cycle for cycle in nx.simple_cycles(inside)]


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
