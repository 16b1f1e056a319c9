"""`launch(..., check=LaunchCheck(...))`: a mistake every rank would refuse (a misspelt
schedule, too many stages, sizes that do not fit the world, a batch that does not split) is
raised once, in the launching process, before any process starts. Checked against an oracle
written from the definitions, and against planted bugs (the check disabled)."""

from __future__ import annotations

import itertools
from typing import Any, NoReturn

import pytest
import torch
from torch import nn

from pipeline import EngineConfig, LaunchCheck, PipelineModule, launch
from pipeline.errors import PipelineConfigError
from pipeline.launcher import processes
from pipeline.runtime import launch_check, shape_trace


class Spawned(Exception):
    """`launch` went on to start ranks."""


@pytest.fixture
def no_rank_may_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting ranks (spawned, or in place under torchrun) raises `Spawned`."""
    def started(*args: Any) -> NoReturn:
        raise Spawned("launch started ranks")

    monkeypatch.setattr(processes, "_spawn", started)
    monkeypatch.setattr(processes, "run_in_place", started)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def _rank_main(*args: Any) -> None:  # never runs: no rank starts in these tests
    raise AssertionError("a rank ran")


def _module(num_stages: int = 2, *, layers: int = 4, chunks: int = 1) -> PipelineModule:
    return PipelineModule([nn.Linear(4, 4) for _ in range(layers)], num_stages=num_stages,
                          chunks=chunks, loss_fn=nn.functional.mse_loss)


MISTAKES = {  # what the user got wrong -> (the launch it makes, what the error must say)
    "misspelt schedule": (lambda: launch(_rank_main, 2, check=LaunchCheck(
        _module(), schedule="1fb1", num_microbatches=4)), r"'1fb1'.*did you mean '1f1b'"),
    "misspelt schedule in a config": (lambda: launch(_rank_main, 2, check=LaunchCheck(
        _module(), EngineConfig(schedule="zbh1", num_microbatches=4))), r"did you mean 'zb-h1'"),
    "more stages than layers": (lambda: launch(_rank_main, 8, check=LaunchCheck(
        _module(8), num_microbatches=8)), r"4 layers cannot fill .* 8 .*use fewer stages"),
    "more stages than ranks": (lambda: launch(_rank_main, 2, check=LaunchCheck(
        _module(4), schedule="1f1b", num_microbatches=4)),
        r"world size 2 is not divisible by num_stages=4 .*launch a multiple of 4 ranks"),
    "tensor parallel that does not fit": (lambda: launch(_rank_main, 6, check=LaunchCheck(
        _module(2), num_microbatches=2, tensor_parallel=2)),
        r"world size 6 is not divisible by num_stages=2 × tensor_parallel=2"),
    "data parallel that does not fit": (lambda: launch(_rank_main, 4, check=LaunchCheck(
        _module(2), num_microbatches=2, data_parallel=3)), r"world size 4 does not match"),
    "chunks the schedule cannot place": (lambda: launch(_rank_main, 2, check=LaunchCheck(
        _module(2, layers=8, chunks=2), schedule="1f1b", num_microbatches=4)),
        r"takes chunks in 1, got 2; use .interleaved."),
    "batch that does not split": (lambda: launch(_rank_main, 2, check=LaunchCheck(
        _module(), num_microbatches=4, inputs=torch.zeros(6, 4), targets=torch.zeros(6, 4))),
        r"inputs batch size 6 is not divisible by num_microbatches=4.*multiple of 4"),
    "targets for other samples": (lambda: launch(_rank_main, 2, check=LaunchCheck(
        _module(), num_microbatches=2, inputs=torch.zeros(8, 4), targets=torch.zeros(4, 4))),
        r"inputs hold 8 samples but targets 4; pass one target per input sample"),
    "inputs of another width": (lambda: launch(_rank_main, 2, check=LaunchCheck(
        _module(), num_microbatches=2, inputs=torch.zeros(8, 5), targets=torch.zeros(8, 4))),
        r"layer 0 \(Linear\) fails on a microbatch of shape \(4, 5\).*give inputs of the shape"),
    "targets the loss would broadcast": (lambda: launch(_rank_main, 2, check=LaunchCheck(
        _module(), num_microbatches=2, inputs=torch.zeros(8, 4), targets=torch.zeros(8, 1))),
        r"loss_fn fails on the last layer's output shape \(4, 4\) and targets shape \(4, 1\)"
        r".*Using a target size"),
    "empty batch": (lambda: launch(_rank_main, 2, check=LaunchCheck(
        _module(), num_microbatches=2, inputs=torch.zeros(0, 4))), r"empty batch"),
    "not a tensor": (lambda: launch(_rank_main, 2, check=LaunchCheck(
        _module(), num_microbatches=2, inputs=[[1.0, 2.0]])), r"must be a tensor"),
}


@pytest.mark.usefixtures("no_rank_may_start")
@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_a_mistake_is_raised_before_any_rank_starts(mistake: str) -> None:
    run, says = MISTAKES[mistake]
    with pytest.raises(PipelineConfigError, match=says):
        run()


@pytest.mark.usefixtures("no_rank_may_start")
def test_every_problem_in_one_error() -> None:
    check = LaunchCheck(_module(4), schedule="1f1b", num_microbatches=4,
                        inputs=torch.zeros(6, 4), targets=torch.zeros(6, 4))
    with pytest.raises(PipelineConfigError) as raised:
        launch(_rank_main, 2, check=check)
    message = str(raised.value)
    assert message.startswith("launch(world_size=2) refused before starting any rank")
    assert "not divisible by num_stages=4" in message and "batch size 6" in message


@pytest.mark.usefixtures("no_rank_may_start")
def test_a_run_that_fits_goes_on_to_start_ranks() -> None:
    check = LaunchCheck(_module(2), schedule="zb-h1", num_microbatches=4,
                        inputs=torch.zeros(8, 4), targets=torch.zeros(8, 4))
    with pytest.raises(Spawned):
        launch(_rank_main, 4, check=check)  # pp 2 × dp 2


@pytest.mark.usefixtures("no_rank_may_start")
def test_a_check_that_is_not_one_is_refused() -> None:
    with pytest.raises(PipelineConfigError, match=r"check must be a pipeline\.LaunchCheck"):
        launch(_rank_main, 2, check=_module())


def _refused_by_definition(world: int, pp: int, tp: int, dp: int | None, batch: int,
                           targets: int, m: int) -> bool:
    """The oracle: the run needs world = pp · dp · tp (dp: what remains when not given), a
    non-empty batch that m divides, and one target per input sample."""
    grid = world % (pp * tp) == 0 if dp is None else pp * dp * tp == world
    return not (grid and batch > 0 and batch % m == 0 and targets % m == 0
                and batch == targets)


CASES = [(world, pp, tp, dp, batch, targets, m)
         for world, pp, tp, dp in itertools.product((1, 2, 4, 6, 8), (1, 2, 4), (1, 2),
                                                    (None, 2))
         for batch, targets, m in ((8, 8, 4), (6, 6, 4), (8, 4, 2), (12, 12, 3), (0, 0, 1))]


def _disagreements(*, first: bool = False) -> list[tuple[int, ...]]:
    """Cases where the check and the oracle differ (`first`: stop at the first one)."""
    wrong: list[tuple[int, ...]] = []
    for world, pp, tp, dp, batch, targets, m in CASES:
        check = LaunchCheck(_module(pp), num_microbatches=m, tensor_parallel=tp,
                            data_parallel=dp, inputs=torch.zeros(batch, 4),
                            targets=torch.zeros(targets, 4), trace=False)
        refused = bool(check.problems(world))
        if refused != _refused_by_definition(world, pp, tp, dp, batch, targets, m):
            wrong.append((world, pp, tp, -1 if dp is None else dp, batch, targets, m))
            if first:
                break
    return wrong


def test_the_check_refuses_what_the_definition_refuses() -> None:
    assert not _disagreements()


def test_planted_bug_no_batch_check_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch_check, "_batch_problems", lambda *args: [])
    assert _disagreements(first=True)  # the oracle notices the batch check is gone


def test_planted_bug_no_size_check_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch_check, "resolve_topology", lambda *args: None)
    assert _disagreements(first=True)


@pytest.mark.usefixtures("no_rank_may_start")
def test_planted_bug_launch_not_checking_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(LaunchCheck, "check", lambda self, world_size: None)
    run, _ = MISTAKES["more stages than ranks"]
    with pytest.raises(Spawned):  # what the first test would see: ranks started
        run()


@pytest.mark.usefixtures("no_rank_may_start")
def test_planted_bug_no_shape_trace_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch_check, "trace_problem", lambda *args, **kwargs: None)
    run, _ = MISTAKES["inputs of another width"]
    with pytest.raises(Spawned):
        run()


def _hf_check(family: str, targets_length: int) -> LaunchCheck:
    pytest.importorskip("transformers")
    from pipeline.interop.hf_layers import causal_lm_targets, layers_from_hf
    from tests.support.hf_models import tiny_config, token_batch

    hf = layers_from_hf(tiny_config(family))
    ids, mask = token_batch(4, 8, padded=True)
    return LaunchCheck(PipelineModule(hf.layers, num_stages=2, loss_fn=hf.loss_fn),
                       num_microbatches=2, inputs=(ids, mask),
                       targets=causal_lm_targets(ids, mask)[:, :targets_length])


def test_a_model_the_meta_device_cannot_run_is_not_refused() -> None:
    # Llama's layers call .item() (no verdict on the meta device); Mistral's trace
    assert _hf_check("llama", 8).problems(2) == []
    assert _hf_check("mistral", 8).problems(2) == []
    assert "loss_fn fails" in " ".join(_hf_check("mistral", 5).problems(2))


def test_planted_bug_meta_limits_taken_for_mistakes_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shape_trace, "_cannot_trace", lambda error: False)
    assert _hf_check("llama", 8).problems(2) != []  # the test above would fail
