"""Every public entry point refuses bad input with a typed error whose message names the bad
value (and says what to do), before any process starts where it can."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from partition import (
    CostFileError,
    PartitionError,
    chain_graph,
    graph_from_json,
    partition_graph,
    partition_layers,
)
from pipeline import LayerSpec, PipelineConfigError, PipelineModule, Topology, launch
from pipeline.cli import main
from pipeline.parallel.topology import TopologyError
from schedules import (
    CostModel,
    ScheduleConfigError,
    build_schedule,
    generate_schedule,
    gpipe,
    simulate,
    validate,
)
from tests.support.pipeline_models import mlp_layers

Case = tuple[str, Callable[[], object], type[Exception], str]
"""(id, the call, the error type, text the message must contain: the bad value)."""


def _module(**kwargs: Any) -> Callable[[], object]:
    arguments = {"layers": mlp_layers(), "num_stages": 2, **kwargs}
    return lambda: PipelineModule(**arguments)


def _rank_function() -> int:
    return 0


MODULE_CASES: list[Case] = [
    ("layers None", _module(layers=None), TypeError, "got None"),
    ("layers a module", _module(layers=nn.Linear(2, 2)), TypeError, "got one Linear"),
    ("layers of ints", _module(layers=[1, 2]), TypeError, "layer 0: int"),
    ("no layers", _module(layers=[]), ValueError, "empty list"),
    ("num_stages 0", _module(num_stages=0), PipelineConfigError, "got 0"),
    ("num_stages float", _module(num_stages=2.0), PipelineConfigError, "got 2.0"),
    ("num_stages bool", _module(num_stages=True), PipelineConfigError, "got True"),
    ("more stages than layers", _module(num_stages=17), PipelineConfigError, "17 × 1 = 17"),
    ("chunks -1", _module(chunks=-1), PipelineConfigError, "got -1"),
    ("loss_fn not callable", _module(loss_fn="mse"), PipelineConfigError, "got 'mse'"),
    ("unknown partition method", _module(partition_method="fast"), PipelineConfigError,
     "'fast'"),
    ("partition method a number", _module(partition_method=5), PipelineConfigError, "got 5"),
    ("cuts out of order", _module(partition_method=[0, 20, 16]), PipelineConfigError,
     "[0, 20, 16]"),
    ("checkpoint interval -1", _module(activation_checkpoint_interval=-1),
     PipelineConfigError, "got -1"),
    ("base_seed a string", _module(base_seed="7"), PipelineConfigError, "got '7'"),
    ("LayerSpec of a non-class", lambda: LayerSpec(3), TypeError, "got 3"),  # type: ignore
    ("LayerSpec with bad args", _module(layers=[LayerSpec(nn.Linear, "a", 2)], num_stages=1),
     TypeError, "args ('a', 2)"),
    ("topology 0", lambda: Topology(0), TopologyError, "got 0"),
]

LAUNCH_CASES: list[Case] = [
    ("world_size 0", lambda: launch(_rank_function, 0), PipelineConfigError, "got 0"),
    ("fn not callable", lambda: launch("main", 1), PipelineConfigError,  # type: ignore
     "got 'main'"),
    ("fn a lambda", lambda: launch(lambda: 0, 1), PipelineConfigError, "not a lambda"),
    ("timeout -1", lambda: launch(_rank_function, 1, timeout=-1), PipelineConfigError,
     "got -1"),
    ("timeout nan", lambda: launch(_rank_function, 1, timeout=math.nan), PipelineConfigError,
     "got nan"),
    ("join_timeout 0", lambda: launch(_rank_function, 1, join_timeout=0), PipelineConfigError,
     "got 0"),
    ("threads 0", lambda: launch(_rank_function, 1, threads_per_rank=0), PipelineConfigError,
     "got 0"),
    ("start method", lambda: launch(_rank_function, 1, start_method="fast"),
     PipelineConfigError, "got 'fast'"),
    ("backend", lambda: launch(_rank_function, 1, backend="mystery"), PipelineConfigError,
     "got 'mystery'"),
    ("grace -1", lambda: launch(_rank_function, 1, grace=-1), PipelineConfigError, "got -1"),
]

GENERATOR_CASES: list[Case] = [
    ("unknown schedule", lambda: build_schedule("pipedream", 2, 4), ScheduleConfigError,
     "'pipedream'"),
    ("ranks 0", lambda: build_schedule("1f1b", 0, 4), ScheduleConfigError, "got 0"),
    ("microbatches str", lambda: build_schedule("1f1b", 2, "4"), ScheduleConfigError,  # type: ignore
     "got '4'"),
    ("chunks for 1f1b", lambda: build_schedule("1f1b", 2, 4, 3), ScheduleConfigError, "got 3"),
    ("memory limit -1", lambda: build_schedule("zb-auto", 2, 4, memory_limit=-1),
     ScheduleConfigError, "got -1"),
    ("costs not a CostModel", lambda: generate_schedule("zb-auto", 2, 4, costs="fast"),  # type: ignore
     ScheduleConfigError, "got 'fast'"),
    ("dualpipev m < 2p", lambda: build_schedule("dualpipev", 2, 1), ScheduleConfigError,
     "got 1"),
    ("negative cost", lambda: CostModel(forward=-1.0), ScheduleConfigError, "got -1.0"),
    ("nan cost per stage", lambda: CostModel(weight=[1.0, math.nan]), ScheduleConfigError,
     "nan"),
    ("cost a string", lambda: CostModel(backward="2"), ScheduleConfigError, "got '2'"),  # type: ignore
    ("simulate a name", lambda: simulate("1f1b"), TypeError, "got '1f1b'"),  # type: ignore
    ("validate a name", lambda: validate("1f1b"), TypeError, "got '1f1b'"),  # type: ignore
    ("costs for 3 stages", lambda: simulate(gpipe(2, 2), CostModel(forward=[1.0] * 3)),
     ScheduleConfigError, "3 values"),
]

PARTITION_CASES: list[Case] = [
    ("graph a list", lambda: partition_graph([1.0, 2.0], 2), PartitionError,  # type: ignore
     "got [1.0, 2.0]"),
    ("stages 0", lambda: partition_graph(chain_graph([1.0, 2.0]), 0), PartitionError,
     "num_stages=0"),
    ("more stages than layers", lambda: partition_graph(chain_graph([1.0]), 3), PartitionError,
     "into 3"),
    ("unknown method", lambda: partition_graph(chain_graph([1.0]), 1, method="fast"),
     PartitionError, "'fast'"),
    ("negative memory cap", lambda: partition_graph(chain_graph([1.0]), 1, memory_cap=-1),
     PartitionError, "memory_cap=-1"),
    ("speeds too short", lambda: partition_graph(chain_graph([1.0, 1.0]), 2, speeds=[1.0]),
     PartitionError, "1 entries for 2 stages"),
    ("empty chain", lambda: chain_graph([]), PartitionError, "got none"),
    ("negative layer cost", lambda: chain_graph([1.0, -2.0]), PartitionError, "-2.0"),
    ("partition_layers 0 stages", lambda: partition_layers([nn.Linear(1, 1)], 0),
     PartitionError, "num_stages=0"),
    ("cost JSON not an object", lambda: graph_from_json({"layers": [7]}), CostFileError,
     "layers[0] is int"),
]

ALL_CASES = MODULE_CASES + LAUNCH_CASES + GENERATOR_CASES + PARTITION_CASES


@pytest.mark.parametrize("case", ALL_CASES, ids=[case[0] for case in ALL_CASES])
def test_entry_point_refuses_bad_input_naming_the_value(case: Case) -> None:
    _, call, error_type, named = case
    with pytest.raises(error_type) as caught:
        call()
    assert named in str(caught.value), str(caught.value)


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def _cli_cases(tmp: Path) -> list[tuple[str, list[str], str]]:
    """(id, argv, text the one-line error names)."""
    good_costs = json.dumps({"layers": [{"forward": 1.0}, {"forward": 2.0}]}).encode()
    return [
        ("simulate --stages 0", ["simulate", "--schedule", "1f1b", "--stages", "0",
                                 "--microbatches", "4"], "got 0"),
        ("simulate --forward -1", ["simulate", "--schedule", "1f1b", "--stages", "2",
                                   "--microbatches", "4", "--forward", "-1"], "'-1'"),
        ("schedule unknown name", ["schedule", "--schedule", "fast", "--stages", "2",
                                   "--microbatches", "4"], "'fast'"),
        ("compare unknown name", ["compare", "--schedules", "1f1b,fast", "--stages", "2",
                                  "--microbatches", "4"], "'fast'"),
        ("partition missing file", ["partition", "--costs", str(tmp / "none.json"),
                                    "--stages", "2"], "none.json"),
        ("partition not UTF-8", ["partition", "--costs", _write(tmp / "bin.json", b"\xff\xfe"),
                                 "--stages", "2"], "not UTF-8"),
        ("partition bad JSON", ["partition", "--costs", _write(tmp / "bad.json", b"{\"layers\""),
                                "--stages", "2"], "not valid JSON"),
        ("partition too many stages", ["partition", "--costs",
                                       _write(tmp / "ok.json", good_costs), "--stages", "3"],
         "into 3"),
        ("partition bad memory cap", ["partition", "--costs", str(tmp / "ok.json"), "--stages",
                                      "2", "--memory-cap", "lots"], "'lots'"),
        ("validate skipped microbatch", ["validate", _write(tmp / "skip.txt",
                                                            b"0F0 0F1 0B0 0B1\n1F0 1B0\n")],
         "microbatch 1"),
        ("validate deadlock", ["validate", _write(tmp / "dead.txt", b"0F0 0B0\n1B0 1F0\n")],
         "deadlock"),
        ("validate garbage", ["validate", _write(tmp / "junk.txt", b"hello world\n")],
         "'hello'"),
        ("validate bad CSV", ["validate", _write(tmp / "bad.csv", b"0F0,0Q1\n")], "0Q1"),
        ("validate binary", ["validate", _write(tmp / "bin.txt", b"\x00\xff")], "not UTF-8"),
        ("verify-checkpoint nothing", ["verify-checkpoint", str(tmp)], "no checkpoint at"),
        ("verify-checkpoint bad manifest",
         ["verify-checkpoint", str(_manifest_dir(tmp, b"{\"format\": 1}"))], "format 1"),
    ]


def _manifest_dir(tmp: Path, manifest: bytes) -> Path:
    step = tmp / "root" / "step_000001"
    step.mkdir(parents=True, exist_ok=True)
    (step / "manifest.json").write_bytes(manifest)
    return step


def test_cli_refuses_bad_input_in_one_line_and_exit_2(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    for name, argv, named in _cli_cases(tmp_path):
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse refuses while parsing
            code = int(exit_.code or 0)
        error = capsys.readouterr().err
        assert code == 2, (name, error)
        first = error.splitlines()[0]
        assert "error:" in first and named in first, (name, error)
        assert "Traceback" not in error, name


def test_cli_accepts_what_it_writes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", "--schedule", "interleaved", "--stages", "2",
                 "--microbatches", "4"]) == 0
    path = tmp_path / "interleaved.txt"
    path.write_text(capsys.readouterr().out)
    assert main(["validate", str(path)]) == 0
    assert "valid — 2 ranks, 4 stages, 4 microbatches" in capsys.readouterr().out
