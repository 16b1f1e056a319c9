"""Messages in `batch_isend_irecv` groups (NCCL's path, run here on gloo): the messages between
two other instructions go out together, and the engine still equals one process for plain,
split-backward, interleaved and V-shaped schedules."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from pipeline import PipelineEngine, PipelineModule, launch
from pipeline.model.reference import build_reference, reference_step
from pipeline.runtime import comm as comm_module
from schedules import Kind
from tests.support.engine3d_models import OPTIMIZERS
from tests.support.pipeline_models import MODELS

pytestmark = pytest.mark.multiprocess

SCHEDULES = ("1f1b", "zb-h1", "interleaved", "zb-v")
_MESSAGES = {Kind.SEND_F, Kind.SEND_B, Kind.RECV_F, Kind.RECV_B}


def _grouped_run() -> dict[str, Any]:
    groups: list[int] = []
    batch = dist.batch_isend_irecv

    def recording(operations: list[Any]) -> Any:
        groups.append(len(operations))
        return batch(operations)

    comm_module.dist.batch_isend_irecv = recording  # type: ignore[assignment]
    spec, m = MODELS["mlp"], 4
    found: dict[str, Any] = {}
    for name in SCHEDULES:
        chunks = 2 if name in ("interleaved", "zb-v") else 1
        module = PipelineModule(spec.layers(), num_stages=2, chunks=chunks, loss_fn=spec.loss)
        engine = PipelineEngine(module, schedule=name, num_microbatches=m,
                                optimizer=OPTIMIZERS["sgd"], timeout=30, local_p2p=False)
        engine.comm.grouped = True
        reference = build_reference(spec.layers())
        error = 0.0
        for step in range(2):
            groups.clear()  # the second step's (the first also sends shape headers)
            inputs, targets = spec.batch(seed=step, batch=2 * m, length=1)
            loss = engine.train_batch(inputs, targets)
            expected = reference_step(reference, inputs, targets, loss_fn=spec.loss,
                                      optimizer=OPTIMIZERS["sgd"])
            error = max(error, abs(loss - expected.loss), *(
                float((p.detach() - expected.params[key]).abs().max())
                for key, p in module.named_layer_parameters()))
        stream = engine.schedule.streams[engine.pp_rank]
        found[name] = {"error": error, "groups": list(groups),
                       "messages": sum(op.kind in _MESSAGES for op in stream)}
        engine.stop_watchdog()
    return found


def test_grouped_messages_equal_one_process_in_groups_per_gap() -> None:
    for rank, found in enumerate(launch(_grouped_run, 2, timeout=60, join_timeout=240)):
        for name, result in found.items():
            assert result["error"] < 2e-5, (rank, name, result)
            # every message goes out once, and messages do share groups (a receive posted
            # one compute op early joins the messages before that op, not its own run)
            assert sum(result["groups"]) == result["messages"], (rank, name, result)
            assert len(result["groups"]) < result["messages"], (rank, name, result)
