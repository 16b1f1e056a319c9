"""API misuse for the reliability report: each call must raise a typed error naming the
problem (TypeError, ValueError or one of ours); an AttributeError is a bare attribute error,
no error at all is silent. Returns (tried, clean, hang, traceback, silent) where
"traceback" counts bare attribute errors and other unexpected exception types.

    python benchmarks/reliability_api.py
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from partition import graph_from_json, partition_graph
from pipeline import EngineConfig, PipelineModule, launch
from pipeline.checkpoint.manifest import parse_manifest, read_manifest, resolve_checkpoint
from pipeline.demo.user_model import load_recipe
from pipeline.errors import PipelineError
from pipeline.files import read_json_file
from pipeline.interop.ds_client_state import read_client_state
from pipeline.limits import check_timeout
from pipeline.parallel.optimizer import make_optimizer
from pipeline.runtime.interpreter import Interpreter
from schedules import CostModel, build_schedule, figures, simulate

__all__ = ["api_misuse"]

Tally = tuple[int, int, int, int, int]


def _loss(loss_fn: Any, out: Any, target: Any) -> Any:
    return Interpreter._loss(SimpleNamespace(loss_fn=loss_fn), out, target)  # type: ignore[arg-type]


def _root(tmp: Path, kind: str) -> str:
    path = tmp / kind
    path.mkdir(exist_ok=True)
    if kind == "fifo-latest" and not (path / "latest").exists():
        os.mkfifo(path / "latest")
    if kind == "fifo-manifest":
        (path / "step_000001").mkdir(exist_ok=True)
        if not (path / "step_000001" / "manifest.json").exists():
            os.mkfifo(path / "step_000001" / "manifest.json")
        return str(path / "step_000001")
    return str(path)


def _fn() -> None:
    return None


def _misuses(tmp: Path) -> dict[str, Callable[[], object]]:
    model, other = nn.Linear(3, 3), nn.Linear(3, 3)
    exits = tmp / "exits.py"
    exits.write_text("import sys\n\ndef build():\n    sys.exit(0)\n")
    evil = tmp / "evil"
    evil.mkdir(exist_ok=True)
    (evil / "manifest.json").write_text("{}")
    torch.save({"x": SimpleNamespace(a=1)}, evil / "client_state.pt")
    return {
        "figures(None)": lambda: figures(None),  # type: ignore[arg-type]
        "figures('timeline')": lambda: figures("timeline"),  # type: ignore[arg-type]
        "simulate(None)": lambda: simulate(None),  # type: ignore[arg-type]
        "simulate(costs='fast')": lambda: simulate(build_schedule("1f1b", 2, 2), "fast"),  # type: ignore[arg-type]
        "CostModel(forward=1e308) makespan": lambda: simulate(build_schedule("1f1b", 4, 8),
                                                              CostModel(forward=1e308)),
        "CostModel(forward=-1)": lambda: CostModel(forward=-1),
        "CostModel(forward=nan)": lambda: CostModel(forward=float("nan")),
        "CostModel(comm='x')": lambda: CostModel(comm="x"),  # type: ignore[arg-type]
        "build_schedule('nope')": lambda: build_schedule("nope", 2, 2),
        "build_schedule(p=0)": lambda: build_schedule("1f1b", 0, 2),
        "build_schedule(m=2.5)": lambda: build_schedule("1f1b", 2, 2.5),  # type: ignore[arg-type]
        "build_schedule(p=10**7, m=10**7)": lambda: build_schedule("1f1b", 10**7, 10**7),
        "EngineConfig(schedule='nope')": lambda: EngineConfig(schedule="nope"),
        "EngineConfig(timeout=-1)": lambda: EngineConfig(timeout=-1),
        "EngineConfig(num_microbatches=0)": lambda: EngineConfig(num_microbatches=0),
        "EngineConfig(schedule=3)": lambda: EngineConfig(schedule=3),  # type: ignore[arg-type]
        "PipelineModule([nn.Linear])": lambda: PipelineModule([nn.Linear], num_stages=1),
        "PipelineModule([], 1)": lambda: PipelineModule([], num_stages=1),
        "PipelineModule(num_stages=0)": lambda: PipelineModule([nn.Linear(2, 2)], num_stages=0),
        "optimizer over other parameters": lambda: make_optimizer(
            torch.optim.SGD(other.parameters(), lr=0.1), list(model.parameters())),
        "optimizer factory returning None": lambda: make_optimizer(lambda params: None,
                                                                   list(model.parameters())),
        "optimizer='sgd'": lambda: make_optimizer("sgd", list(model.parameters())),  # type: ignore[arg-type]
        "targets (8,1) vs outputs (8,4)": lambda: _loss(F.mse_loss, torch.randn(8, 4),
                                                        torch.randn(8, 1)),
        "loss_fn returning a float": lambda: _loss(lambda o, t: 0.5, torch.randn(2),
                                                   torch.randn(2)),
        "loss_fn returning a vector": lambda: _loss(lambda o, t: o - t, torch.randn(2),
                                                    torch.randn(2)),
        "loss_fn returning None": lambda: _loss(lambda o, t: None, torch.randn(2),
                                                torch.randn(2)),
        "launch(fn, 10**6)": lambda: launch(_fn, 10**6),
        "launch(fn, 0)": lambda: launch(_fn, 0),
        "launch(timeout=1e300)": lambda: launch(_fn, 2, timeout=1e300),
        "launch(lambda)": lambda: launch(lambda: None, 1),
        "launch(backend='nope')": lambda: launch(_fn, 2, backend="nope"),
        "check_timeout(1e12)": lambda: check_timeout(1e12),
        "--model calling sys.exit(0)": lambda: load_recipe(f"{exits}:build"),
        "--model without a colon": lambda: load_recipe("model.py"),
        "read_json_file(/dev/zero)": lambda: read_json_file("/dev/zero", 1 << 20),
        "resolve_checkpoint(FIFO latest)": lambda: resolve_checkpoint(_root(tmp, "fifo-latest")),
        "read_manifest(FIFO manifest)": lambda: read_manifest(_root(tmp, "fifo-manifest")),
        "parse_manifest(b'[]')": lambda: parse_manifest(b"[]"),
        "parse_manifest(deep)": lambda: parse_manifest(b"[" * 100000 + b"]" * 100000),
        "client_state with an object": lambda: read_client_state(evil),
        "graph_from_json(None)": lambda: graph_from_json(None),  # type: ignore[arg-type]
        "graph_from_json({})": lambda: graph_from_json({}),
        "partition_graph(stages=0)": lambda: partition_graph(
            graph_from_json({"layers": [{"forward": 1, "backward": 1}]}), 0),
    }


def api_misuse() -> Tally:
    clean = bare = silent = other = 0
    print("| misuse | outcome |\n|---|---|")
    with tempfile.TemporaryDirectory() as root:
        for name, call in _misuses(Path(root)).items():
            try:
                call()
                silent, outcome = silent + 1, "SILENT"
            except AttributeError as error:
                bare, outcome = bare + 1, f"bare AttributeError: {error}"
            except (TypeError, ValueError, PipelineError) as error:
                clean, outcome = clean + 1, f"{type(error).__name__}: {str(error)[:90]}"
            except Exception as error:  # anything else reaches the user as a traceback
                other, outcome = other + 1, f"unexpected {type(error).__name__}: {error}"
            print(f"| {name} | {outcome.splitlines()[0]} |", flush=True)
    total = clean + bare + silent + other
    print(f"\n{total} misuses: {clean} refused with a typed error, {bare} bare attribute "
          f"errors, {other} other exceptions, {silent} silent")
    return total, clean, 0, bare + other, silent


if __name__ == "__main__":
    print(api_misuse())
