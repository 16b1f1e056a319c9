"""The staged backend (device tensors over gloo through host buffers, for ranks sharing a GPU):
chosen where NCCL would refuse, and the engine's 3D configurations equal one process through
it, rehearsed on CPU ranks that copy every message through host buffers."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pipeline import PipelineConfigError, launch
from pipeline.device import NCCL_PER_DEVICE, STAGED_PER_DEVICE, backend_reason, default_backend
from pipeline.device import accelerator as device_module
from tests.support.device_tier import REHEARSAL_BACKEND
from tests.support.engine3d_models import Case, run_case

CASES = [
    Case("pp2×tp2 +clip", "tp", {"tensor_parallel": 2, "gradient_clipping": 0.05}),
    Case("pp2×dp2 ZeRO-1 +clip", "mlp", {"data_parallel": 2, "zero_stage": 1,
                                         "gradient_clipping": 0.05, "bucket_mb": 2**-10},
         optimizer="adam"),
]


@pytest.mark.parametrize(("cuda", "gpus", "ranks", "expected"), [
    (False, 0, 4, "gloo"), (True, 1, 1, NCCL_PER_DEVICE), (True, 4, 4, NCCL_PER_DEVICE),
    (True, 1, 2, STAGED_PER_DEVICE), (True, 2, 8, STAGED_PER_DEVICE)])
def test_backend_is_nccl_only_where_every_rank_has_its_own_gpu(
        monkeypatch: pytest.MonkeyPatch, cuda: bool, gpus: int, ranks: int,
        expected: str) -> None:
    monkeypatch.setattr(device_module, "_has_cuda", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert default_backend(ranks) == expected
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))  # torchrun's count of this host's ranks
    assert default_backend() == expected


def test_staged_choice_is_named_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    line = backend_reason(STAGED_PER_DEVICE, 4)
    assert "4 ranks share 1 GPU(s)" in line and "NCCL refuses" in line and "gloo" in line


def test_an_unknown_backend_per_device_is_refused_before_any_rank_starts() -> None:
    with pytest.raises(PipelineConfigError, match="cpu:gloo,cuda:pipesched_staged"):
        launch(print, 2, backend="cpu:no-such-backend")


def _staged_cases(plant_missing_copy_back: bool) -> list[dict[str, Any]]:
    if plant_missing_copy_back:  # a planted bug: received bytes never reach the tensor
        from pipeline.device import staged_backend
        staged_backend.copy_from_host = lambda tensor, host: None
    try:
        return [run_case(case) for case in CASES]
    except Exception as error:  # the planted bug may also break the run outright
        return [{"case": "run", "failed": f"{type(error).__name__}: {error}"}]


@pytest.mark.multiprocess
def test_3d_configurations_through_staged_messages_equal_one_process() -> None:
    for results in launch(_staged_cases, 4, False, backend=REHEARSAL_BACKEND, timeout=60,
                          join_timeout=240):
        for result in results:
            assert "failed" not in result, result
            assert result["loss"] < 2e-5 and result["grad"] < 2e-5, result
            assert result["param"] < 2e-5, result


@pytest.mark.multiprocess
def test_a_staged_receive_that_is_never_copied_back_is_caught() -> None:
    results = launch(_staged_cases, 4, True, backend=REHEARSAL_BACKEND, timeout=30,
                     join_timeout=240)
    assert any("failed" in result or result["loss"] > 1e-3 or result["param"] > 1e-3
               for rank in results for result in rank)
