"""Imports flow one way: between the top-level packages, and between `pipeline/`'s rooms."""

from __future__ import annotations

import ast
from pathlib import Path

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
# pipeline's rooms, lowest first: cli -> demo -> planner -> interop -> runtime -> checkpoint ->
# model -> parallel -> launcher -> the shared leaves (pipeline/errors.py, pipeline/device.py).
ROOMS = ("", "launcher", "parallel", "model", "checkpoint", "runtime", "interop", "planner", "demo",
         "cli")


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return names


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
