"""`LaunchCheck` refuses what every rank would fail on and stays bounded itself (issue 49 item
7): a layer that never returns, `sys.exit` in a layer or the loss, inputs of a dtype the
layers do not take, a loss that returns no tensor, targets without inputs. The dtype rule is
checked against an oracle: the real layers run on real tensors, as a rank would."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, NoReturn

import pytest
import torch
from torch import nn

from pipeline import LaunchCheck, PipelineModule, launch
from pipeline.errors import PipelineConfigError
from pipeline.launcher import processes


class Spawned(Exception):
    """`launch` went on to start ranks."""


@pytest.fixture(autouse=True)
def no_rank_may_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def started(*args: Any) -> NoReturn:
        raise Spawned("launch started ranks")

    monkeypatch.setattr(processes, "_spawn", started)
    monkeypatch.setattr(processes, "run_in_place", started)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def _rank_main(*args: Any) -> None:  # never runs: no rank starts in these tests
    raise AssertionError("a rank ran")


class Forever(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        while True:
            x = x + 0


class Exits(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sys.exit(3)


def _string_loss(outputs: torch.Tensor, targets: torch.Tensor) -> Any:
    return "mse"


def _exiting_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    sys.exit(0)


def _module(*middle: nn.Module, loss: Any = nn.functional.mse_loss) -> PipelineModule:
    return PipelineModule([nn.Linear(4, 4), *middle, nn.Linear(4, 4)], num_stages=2,
                          loss_fn=loss)


def _launch(module: PipelineModule, inputs: Any = None, targets: Any = None,
            **options: Any) -> None:
    launch(_rank_main, 2, check=LaunchCheck(module, num_microbatches=2, inputs=inputs,
                                            targets=targets, **options))


X, Y = torch.zeros(8, 4), torch.zeros(8, 4)
MISTAKES = {  # what the user got wrong -> (the launch it makes, what the error must say)
    "a layer that never returns": (
        lambda: _launch(_module(Forever()), X, Y, trace_timeout=0.5),
        r"did not finish within trace_timeout=0.5 s.*never returns would hang every rank"),
    "sys.exit in a layer": (lambda: _launch(_module(Exits()), X, Y),
                            r"layer 1 \(Exits\) .*called sys.exit\(3\), which would end every"),
    "sys.exit in the loss": (lambda: _launch(_module(loss=_exiting_loss), X, Y),
                             r"loss_fn fails .*called sys.exit\(0\)"),
    "int64 inputs to a Linear": (lambda: _launch(_module(), X.long(), Y),
                                 r"layer 0 \(Linear\) fails .*torch.float32 and torch.int64"),
    "complex inputs": (lambda: _launch(_module(), X.to(torch.complex64), Y),
                       r"torch.complex64 and torch.float32 tensors"),
    "a loss that returns a string": (lambda: _launch(_module(loss=_string_loss), X, Y),
                                     r"loss_fn returns str 'mse', not a one-element tensor"),
    "targets without inputs": (lambda: _launch(_module(), None, Y),
                               r"targets given without inputs"),
    "a bad trace_timeout": (lambda: _launch(_module(), X, Y, trace_timeout=float("nan")),
                            r"trace_timeout must be a number of seconds > 0, got nan"),
}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_a_mistake_every_rank_would_fail_on_is_refused_in_the_launcher(mistake: str) -> None:
    run, says = MISTAKES[mistake]
    with pytest.raises(PipelineConfigError, match=says):
        run()


def test_a_refused_endless_layer_is_stopped() -> None:
    with pytest.raises(PipelineConfigError, match="did not finish"):
        _launch(_module(Forever()), X, Y, trace_timeout=0.2)
    deadline = time.monotonic() + 10
    while any(t.name == "pipesched-launch-check-trace" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the endless trace still runs"
        time.sleep(0.05)


def test_token_ids_into_an_embedding_go_on_to_start_ranks() -> None:
    module = PipelineModule([nn.Embedding(10, 4), nn.Linear(4, 4)], num_stages=2,
                            loss_fn=nn.functional.mse_loss)
    with pytest.raises(Spawned):
        _launch(module, torch.zeros(8, 3, dtype=torch.long), torch.zeros(8, 3, 4))


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
          torch.int32, torch.complex64, torch.bool]


def _a_rank_fails(dtype: torch.dtype, precision: str) -> bool:
    """The oracle: the layers on one real microbatch, under the engine's autocast."""
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32"):
            layers(torch.ones(4, 4).to(dtype))
    except RuntimeError:
        return True
    return False


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_dtype_check_refuses_what_the_real_layers_refuse(precision: str) -> None:
    for dtype in DTYPES:
        check = LaunchCheck(_module(), num_microbatches=2, precision=precision,
                            inputs=torch.ones(8, 4).to(dtype))
        refused = any("tensors: torch refuses mixed dtypes" in problem
                      for problem in check.problems(2))
        assert refused == _a_rank_fails(dtype, precision), (dtype, precision)
