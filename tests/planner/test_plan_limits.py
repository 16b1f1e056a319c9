"""The planner refuses, before searching, requests whose work would run for hours (the
estimate bounds what the search really enumerates), and shapes it would misread."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.planner import SearchOptions
from pipeline.planner.cluster import PRESETS
from pipeline.planner.errors import PlanError
from pipeline.planner.grid import configurations
from pipeline.planner.limits import (
    MAX_PLAN_INSTRUCTIONS,
    check_plan_work,
    divisors,
    estimate_plan_work,
)
from pipeline.planner.load import load_model
from tests.support.cli_helpers import call_cli

_SHAPE = "layers=24,hidden=2048,heads=16,vocab=50257,seq=2048"


@pytest.mark.parametrize("n", [1, 2, 12, 36, 97, 720, 1024, 720720])
def test_divisors_match_the_definition(n: int) -> None:
    assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


@pytest.mark.parametrize("global_batch", [8, 48, 256, 360])
def test_estimate_bounds_what_the_search_enumerates(global_batch: int) -> None:
    model = load_model(_SHAPE)
    cluster = PRESETS["a100-80g"]
    options = SearchOptions()
    simulated = sum(3 * c.pp * c.chunks * c.num_microbatches
                    for c in configurations(model, cluster, global_batch, options))
    estimate = estimate_plan_work(len(model.layers), cluster.num_devices,
                                  divisors(cluster.devices_per_node), global_batch,
                                  options.schedules, options.max_chunks)
    assert simulated <= estimate <= 4 * simulated  # an upper bound, not a wild one


@pytest.mark.parametrize(("args", "message"), [
    (["--global-batch", "720720"], "--global-batch 720,720 on 8 devices would have the "
                                   "search simulate up to"),
    (["--global-batch", str(10**12)], "--global-batch 1,000,000,000,000 is over the "
                                      "planner's limit"),
    (["--global-batch", "8", "--nodes", str(10**12)], "--nodes 1,000,000,000,000 gives"),
])
def test_plan_refuses_work_that_would_run_for_hours(args: list[str], message: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # regression: these ran for over 60 s (hangs in the adversarial pass)
    assert main(["plan", "--model", _SHAPE, "--cluster", "a100-80g", *args]) == 2
    assert capsys.readouterr().err.startswith(f"pipesched plan: error: {message}")


@pytest.mark.parametrize(("shape", "message"), [
    ("layers=1000000000000,hidden=64,heads=4,vocab=100,seq=32", "1,000,000,000,000 layers"),
    ("layers=2,hidden=64,heads=4,vocab=100,seq=32,ffn=0", "ffn=0: must be >= 1"),
    ("layers=2,hidden=64,heads=4,vocab=100,seq=32,kv_heads=0", "kv_heads=0: must be >= 1"),
    ("layers=2,layers=4,hidden=64,heads=4,vocab=100,seq=32", "gives layers= twice"),
])
def test_plan_refuses_shapes_it_would_misread(shape: str, message: str) -> None:
    # regression: ffn=0 became 1024, the last of two layers= won, 10^12 layers hung
    with pytest.raises(PlanError, match=message):
        load_model(shape)


def test_an_ordinary_request_is_within_the_limit() -> None:
    model = load_model(_SHAPE)
    cluster = PRESETS["a100-80g"]
    options = SearchOptions()
    work = check_plan_work(len(model.layers), 1, 8, divisors(8), 4096, options.schedules,
                           options.max_chunks)
    assert 0 < work <= MAX_PLAN_INSTRUCTIONS and cluster.num_devices == 8


def test_plan_refuses_a_duplicate_json_key(tmp_path: Path) -> None:
    path = tmp_path / "shape.json"
    path.write_text('{"layers": 2, "layers": 3, "hidden": 64, "heads": 4, "vocab": 100, '
                    '"seq": 32}')
    done = call_cli("plan", "--model", str(path), "--cluster", "a100-80g", "--global-batch",
                    "8")
    assert done.returncode == 2 and "gives the key 'layers' twice" in done.stderr


def test_the_papers_largest_run_is_not_refused_by_the_work_limit() -> None:
    # regression: the 1T shape on 3,072 A100s (Megatron-LM's Table 1) was refused by the CLI
    model = load_model("layers=128,hidden=25600,heads=160,vocab=51200,seq=2048")
    cluster = PRESETS["a100-80g"]
    options = SearchOptions()
    work = check_plan_work(len(model.layers), 384, cluster.devices_per_node,
                           divisors(cluster.devices_per_node), 3072, options.schedules,
                           options.max_chunks)
    assert work <= MAX_PLAN_INSTRUCTIONS
