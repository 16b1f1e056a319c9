"""README.md and docs/*.md: links resolve, code blocks still work, the folder map matches the code.

Marker convention for code blocks (see docs/README.md's "Writing these pages"):

- `<!-- runnable -->` on the line right before a fenced ```python or ```bash block: the test
  runs it (python: written to a file in a temporary directory and run there with
  PYTHONPATH set to the repository; bash: `bash -e` in a temporary directory, same
  PYTHONPATH, so `pipesched` runs this checkout's code). Only for blocks that finish within a
  few seconds on a CPU and need no network, GPU or optional package.
- `<!-- not run: REASON -->` instead says why a block is not run (it installs packages, needs
  a GPU, hosts or a checkpoint, or is a fragment); a test it names must exist. Every ```python
  and ```bash block carries one of the two (issue 46: a refused example had landed because
  CI only compiled it).
- Every other ```python block is compiled with `compile()` and each name it imports from our
  packages (`pipeline`, `schedules`, `partition`, `viz`) must resolve.
- Every other ```bash block: each `pipesched COMMAND --flag` in it must name a real
  subcommand and real flags, and each `python path/to/file.py` must name a file that exists.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
OUR_PACKAGES = ("pipeline", "schedules", "partition", "viz")
RUNNABLE = "<!-- runnable -->"
_NOT_RUN = re.compile(r"^<!-- not run: (?P<why>.+?) -->$")
RUN_TIMEOUT = 120.0   # seconds; a block takes a few on a quiet machine

_FENCE = re.compile(r"^```(\w*)\s*$")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: Path
    line: int
    language: str
    text: str
    runnable: bool
    not_run: str | None = None
    """The reason its `<!-- not run: ... -->` marker gives (None: no such marker)."""

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        match = _FENCE.match(lines[index])
        if match is None:
            index += 1
            continue
        start = index
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        runnable = start > 0 and lines[start - 1].strip() == RUNNABLE
        exempt = _NOT_RUN.match(lines[start - 1].strip()) if start > 0 else None
        blocks.append(Block(page, start + 1, match.group(1), "\n".join(lines[start + 1:end]),
                            runnable, exempt["why"] if exempt else None))
        index = end + 1
    return blocks


def _prose(page: Path) -> str:
    """The page without its fenced blocks (a `[x](y)` inside code is not a link)."""
    kept: list[str] = []
    inside = False
    for line in page.read_text().splitlines():
        if _FENCE.match(line) or (inside and line.strip() == "```"):
            inside = not inside
            continue
        if not inside:
            kept.append(line)
    return "\n".join(kept)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[`*_]", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    anchors: set[str] = set()
    counts: dict[str, int] = {}
    for line in _prose(page).splitlines():
        match = _HEADING.match(line)
        if match is None:
            continue
        slug = _slug(match.group(2))
        seen = counts.get(slug, 0)
        counts[slug] = seen + 1
        anchors.add(slug if seen == 0 else f"{slug}-{seen}")
    return anchors


ALL_BLOCKS = [block for page in PAGES for block in _blocks(page)]


def test_the_pages_exist() -> None:
    names = {page.name for page in PAGES}
    assert {"README.md", "benchmarks.md", "cli.md", "getting-started.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_relative_links_resolve(page: Path) -> None:
    problems: list[str] = []
    for target in _LINK.findall(_prose(page)):
        if re.match(r"^[a-z]+:", target):
            continue
        path_part, _, anchor = target.partition("#")
        destination = (page.parent / path_part).resolve() if path_part else page
        if not destination.exists():
            problems.append(f"{target}: {destination} does not exist")
            continue
        if anchor and destination.suffix == ".md" and anchor not in _anchors(destination):
            problems.append(f"{target}: no heading with anchor #{anchor} in {destination.name}")
    assert not problems, f"{page.name}: " + "; ".join(problems)


def _imported_names(tree: ast.AST) -> list[tuple[str, str | None]]:
    names: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.extend((node.module, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            names.extend((alias.name, None) for alias in node.names)
    return [(module, name) for module, name in names if module.split(".")[0] in OUR_PACKAGES]


PYTHON_BLOCKS = [block for block in ALL_BLOCKS if block.language == "python"]


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=str)
def test_python_blocks_compile_and_their_imports_resolve(block: Block) -> None:
    tree = ast.parse(block.text, filename=str(block))
    compile(tree, str(block), "exec")
    missing: list[str] = []
    for module_name, name in _imported_names(tree):
        module = importlib.import_module(module_name)
        if name is not None and not hasattr(module, name):
            try:
                importlib.import_module(f"{module_name}.{name}")
            except ImportError:
                missing.append(f"{module_name}.{name}")
    assert not missing, f"{block}: cannot import {missing}"


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise LookupError("the pipesched parser has no subcommands")


SUBCOMMANDS = _subcommands()


def _commands(text: str) -> list[list[str]]:
    """Each shell command of a bash block, split into words (continuations joined)."""
    joined = re.sub(r"\\\n", " ", text)
    commands: list[list[str]] = []
    for line in joined.splitlines():
        line = line.split(" #")[0].strip()
        if not line or line.startswith("#"):
            continue
        for part in re.split(r"&&|;|\|", line):
            words = shlex.split(part)
            while words and "=" in words[0] and not words[0].startswith("-"):
                words = words[1:]                        # VAR=value prefixes
            if words:
                commands.append(words)
    return commands


def _check_pipesched(words: list[str]) -> list[str]:
    if len(words) < 2 or words[1].startswith("-"):
        return []
    parser = SUBCOMMANDS.get(words[1])
    if parser is None:
        return [f"no subcommand {words[1]!r}"]
    known = {option for action in parser._actions for option in action.option_strings}
    flags = [word.split("=")[0] for word in words[2:] if word.startswith("--")]
    return [f"pipesched {words[1]} has no {flag}" for flag in flags if flag not in known]


BASH_BLOCKS = [block for block in ALL_BLOCKS if block.language == "bash"]


@pytest.mark.parametrize("block", BASH_BLOCKS, ids=str)
def test_bash_blocks_name_real_commands_flags_and_files(block: Block) -> None:
    problems: list[str] = []
    for words in _commands(block.text):
        if words[0] == "pipesched":
            problems.extend(_check_pipesched(words))
        elif words[0] == "python" and len(words) > 2 and words[1] == "-m" \
                and words[2] == "pipeline.cli":
            problems.extend(_check_pipesched(["pipesched", *words[3:]]))
        elif words[0] in ("python", "torchrun") and len(words) > 1:
            scripts = [word for word in words[1:] if word.endswith(".py") and "/" in word]
            problems.extend(f"{script} does not exist" for script in scripts[:1]
                            if not (ROOT / script).exists())
    assert not problems, f"{block}: " + "; ".join(problems)


RUNNABLE_BLOCKS = [block for block in ALL_BLOCKS if block.runnable]


def _runnable_param(block: Block) -> object:
    """Blocks that start ranks are `multiprocess` (the fast loop skips them)."""
    spawns = "launch(" in block.text or "pipesched train" in block.text \
        or "pipesched rehearse" in block.text
    return pytest.param(block, id=str(block),
                        marks=[pytest.mark.multiprocess] if spawns else [])


def test_every_code_block_runs_or_says_why_not() -> None:
    silent = [str(block) for block in ALL_BLOCKS
              if block.language in ("python", "bash") and not block.runnable
              and block.not_run is None]
    assert not silent, (f"blocks neither {RUNNABLE} nor <!-- not run: REASON -->: {silent}")
    for block in ALL_BLOCKS:
        if block.not_run is None:
            continue
        assert len(block.not_run.split()) >= 3, f"{block}: say why it is not run"
        for named in re.findall(r"tests/[\w/]+\.py", block.not_run):
            assert (ROOT / named).is_file(), f"{block}: its reason names {named}, not a file"


def test_a_silent_block_is_found(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("text\n\n```bash\npipesched train\n```\n\n<!-- not run: it needs "
                    "two hosts -->\n```bash\ntorchrun x\n```\n")
    found = _blocks(page)
    assert [(block.runnable, block.not_run) for block in found] == [
        (False, None), (False, "it needs two hosts")]


def test_runnable_blocks_are_python_or_bash() -> None:
    assert RUNNABLE_BLOCKS, "no block is marked runnable"
    assert {block.language for block in RUNNABLE_BLOCKS} <= {"python", "bash"}


@pytest.mark.parametrize("block", [_runnable_param(block) for block in RUNNABLE_BLOCKS])
def test_runnable_blocks_run(block: Block, tmp_path: Path) -> None:
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    for folder in ("benchmarks", "examples"):   # paths in the docs are relative to the root
        (tmp_path / folder).symlink_to(ROOT / folder)
    if block.language == "python":
        script = tmp_path / "block.py"
        script.write_text(block.text + "\n")
        command = [sys.executable, str(script)]
    else:
        command = ["bash", "-e", "-c", block.text]
    finished = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True,
                              text=True, timeout=RUN_TIMEOUT, check=False)
    assert finished.returncode == 0, (
        f"{block} exited {finished.returncode}\n{finished.stdout[-2000:]}\n"
        f"{finished.stderr[-4000:]}")


def _folder_map(page: Path) -> list[str]:
    """The first cells of README tables that name a folder: `schedules/`, `cli/`, ..."""
    return re.findall(r"^\| `([\w./]+/)` \|", page.read_text(), flags=re.MULTILINE)


def test_the_readme_folder_map_matches_the_code() -> None:
    listed = _folder_map(ROOT / "README.md")
    top = [name for name in listed if (ROOT / name).is_dir()]
    rooms = [name for name in listed if name not in top]
    assert not [name for name in rooms if not (ROOT / "pipeline" / name).is_dir()], (
        f"README lists folders that do not exist: {listed}")
    actual_rooms = {path.name + "/" for path in (ROOT / "pipeline").iterdir()
                    if path.is_dir() and (path / "__init__.py").exists()}
    assert actual_rooms <= set(rooms), (
        f"pipeline/ rooms missing from the README's map: {sorted(actual_rooms - set(rooms))}")
    packages = {path.name + "/" for path in ROOT.iterdir()
                if path.is_dir() and (path / "__init__.py").exists() and path.name != "tests"}
    assert packages <= set(top), f"packages missing from the README's map: {packages - set(top)}"
