"""API misuse that used to give a silent wrong result or a bare attribute error is refused
with a typed error naming the value and the fix."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline import EngineConfig
from pipeline.demo.user_model import load_recipe
from pipeline.errors import PipelineConfigError
from pipeline.parallel.optimizer import make_optimizer
from pipeline.runtime.interpreter import Interpreter


def _loss(loss_fn: object, out: object, target: object) -> torch.Tensor:
    """The interpreter's loss call, on a stand-in holding only what it reads."""
    return Interpreter._loss(SimpleNamespace(loss_fn=loss_fn, _loss_checked=True),  # type: ignore[arg-type]
                             out, target)


def test_an_optimizer_over_other_parameters_is_refused() -> None:
    # regression: it stepped tensors no stage reads, trained nothing, and the losses came back
    model, other = nn.Linear(3, 3), nn.Linear(3, 3)
    mine = list(model.parameters())
    with pytest.raises(ValueError, match="2 of them not parameters of this rank's stages, "
                                         "and misses 2 of its 2"):
        make_optimizer(torch.optim.SGD(other.parameters(), lr=0.1), mine)
    with pytest.raises(ValueError, match="misses 1 of its 2"):
        make_optimizer(torch.optim.SGD([model.weight], lr=0.1), mine)
    same = torch.optim.SGD(model.parameters(), lr=0.1)
    assert make_optimizer(same, mine) is same


def test_targets_that_torch_would_broadcast_are_refused() -> None:
    # regression: outputs (8, 4) against targets (8, 1) were broadcast into a wrong loss,
    # with only torch's warning on the ranks' stderr
    outputs, targets = torch.randn(8, 4), torch.randn(8, 1)
    with pytest.raises(ValueError, match=r"outputs of shape \(8, 4\) and targets of shape "
                                         r"\(8, 1\), which torch would broadcast"):
        _loss(F.mse_loss, outputs, targets)
    matching = torch.randn(8, 4)
    assert torch.equal(_loss(F.mse_loss, outputs, matching), F.mse_loss(outputs, matching))
    classes = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])  # different shapes by design: allowed
    assert _loss(F.cross_entropy, outputs, classes).numel() == 1


@pytest.mark.parametrize(("returned", "message"), [
    (lambda out, target: 0.5, "got float 0.5"),
    (lambda out, target: F.mse_loss(out, target).item(), "got float"),
    (lambda out, target: (out - target) ** 2, r"got a tensor of shape \(8, 4\)"),
])
def test_a_loss_that_is_not_a_one_element_tensor_is_a_type_error(returned: object,
                                                                 message: str) -> None:
    # regression: a float loss gave "AttributeError: 'float' object has no attribute 'detach'"
    with pytest.raises(TypeError, match=f"must return a one-element tensor.*{message}"):
        _loss(returned, torch.randn(8, 4), torch.randn(8, 4))


def test_an_unknown_schedule_is_refused_when_the_config_is_built() -> None:
    # regression: EngineConfig(schedule="nope") was accepted until the engine was built
    with pytest.raises(PipelineConfigError, match=r"schedule '1fb1' is not a registered "
                                                  r"schedule \(did you mean '1f1b'\?\)"):
        EngineConfig(schedule="1fb1")
    assert EngineConfig(schedule="interleaved").schedule == "interleaved"
    with pytest.raises(PipelineConfigError, match=r"timeout must be a number of seconds in"):
        EngineConfig(timeout=1e300)  # would overflow torch's millisecond count later


def test_a_model_function_calling_sys_exit_is_refused(tmp_path: Path) -> None:
    # regression: `pipesched train --model m.py:build` exited 0 with no output
    path = tmp_path / "exits.py"
    path.write_text("import sys\n\ndef build():\n    sys.exit(0)\n")
    with pytest.raises(ValueError, match=r"called sys.exit\(0\) instead of returning"):
        load_recipe(f"{path}:build")
    path = tmp_path / "exits_on_import.py"
    path.write_text("import sys\nsys.exit(3)\n\ndef build():\n    pass\n")
    with pytest.raises(ValueError, match=r"importing .* called sys.exit\(3\)"):
        load_recipe(f"{path}:build")
