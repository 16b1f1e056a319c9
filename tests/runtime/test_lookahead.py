"""Receives posted one compute op early (`pipeline.runtime.lookahead`): which ones, and that
training stays equal to a single process once they are (steps after the first, whose
activation layouts are cached, so forward receives move too)."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline import LayerSpec, PipelineEngine, PipelineModule, launch
from pipeline.model.reference import build_reference, reference_step
from pipeline.runtime.lookahead import early_receives
from schedules import NONE, Instruction, Kind, generate_schedule
from tests.support.equivalence import describe_errors, new_errors, record_step, sgd
from tests.support.pipeline_models import MODELS


def _op(kind: Kind, stage: int = 0, microbatch: int = 0, peer: int = NONE) -> Instruction:
    return Instruction(kind, stage, microbatch, peer)


def test_receives_move_before_the_compute_op_that_precedes_them() -> None:
    stream = [_op(Kind.RECV_F, 1, 0, 0),  # before any compute: stays
              _op(Kind.F, 1, 0), _op(Kind.SEND_F, 1, 0, 2), _op(Kind.RECV_F, 1, 1, 0),
              _op(Kind.RECV_B, 1, 0, 2),
              _op(Kind.F, 1, 1), _op(Kind.B, 1, 0), _op(Kind.RECV_B, 1, 1, 2),
              _op(Kind.REDUCE_GRAD, 1), _op(Kind.STEP)]
    # the gradient receive after B stays behind it (a second gradient during a backward)
    assert early_receives(stream) == {1: [3, 4]}


def test_gradient_receives_stay_behind_a_backward_and_keep_their_order() -> None:
    stream = [_op(Kind.F, 0, 1), _op(Kind.RECV_B, 0, 0, 1), _op(Kind.B, 0, 0),
              _op(Kind.RECV_B, 0, 1, 1), _op(Kind.RECV_F, 0, 2, 1), _op(Kind.I, 0, 1),
              _op(Kind.RECV_F, 0, 3, 1), _op(Kind.W, 0, 1), _op(Kind.RECV_B, 0, 2, 1)]
    # RECV_F after I moves (an activation is not a gradient); the later RECV_F stays behind
    # the RECV_B that stayed; after W (no gradient consumed) a gradient receive moves
    assert early_receives(stream) == {0: [1], 5: [6], 7: [8]}


def test_streams_without_receives_post_nothing_early() -> None:
    schedule = generate_schedule("1f1b", 1, 3)
    assert early_receives(schedule.streams[0]) == {}


SCHEDULES = ("1f1b", "interleaved", "zb-v", "dualpipev")
STEPS = 3


def _lookahead_rank(p: int, m: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    results = []
    for name in SCHEDULES:
        for model in ("mlp", "transformer"):
            spec = MODELS[model]
            schedule = generate_schedule(name, p, m)
            module = PipelineModule(spec.layers(), num_stages=p, chunks=schedule.chunks,
                                    loss_fn=spec.loss)
            engine = PipelineEngine(module, schedule=schedule, optimizer=sgd, timeout=30)
            interpreter = engine._interpreter
            early: list[str] = []
            can_post = interpreter._can_post_early

            def counted(op: Instruction, can_post: Any = can_post,
                        early: list[str] = early) -> bool:
                allowed = bool(can_post(op))
                if allowed:
                    early.append(op.kind.value)
                return allowed

            interpreter._can_post_early = counted  # type: ignore[method-assign]
            reference = build_reference(spec.layers())
            errors = new_errors()
            length = spec.lengths[-1]  # one signature: every step after the first is cached
            for step in range(STEPS):
                inputs, targets = spec.batch(seed=step, batch=3 * m, length=length)
                loss = engine.train_batch(inputs, targets)
                expected = reference_step(reference, inputs, targets, loss_fn=spec.loss,
                                          optimizer=sgd)
                record_step(errors, module.named_layer_parameters(), loss, expected,
                            f"{name} {model} step {step}")
            results.append({"label": f"{name} {model}", "errors": errors,
                            "early": sorted(set(early))})
    return results


@pytest.mark.multiprocess
def test_training_with_early_receives_equals_a_single_process() -> None:
    p, m = 2, 4
    per_rank = launch(_lookahead_rank, p, p, m, timeout=600)
    problems = [line for rank, results in enumerate(per_rank) for result in results
                for line in describe_errors(rank, result["label"], result["errors"])]
    assert not problems, "\n".join(problems)
    for rank, results in enumerate(per_rank):
        for result in results:  # the path under test ran: both kinds of receive moved
            receives = {Kind.RECV_F.value, Kind.RECV_B.value}
            if result["label"].startswith(("zb-v", "dualpipev", "interleaved")):
                assert set(result["early"]) == receives, (rank, result)
            else:  # 1F1B: stage 0 receives only gradients, the last stage only activations
                assert len(result["early"]) == 1, (rank, result)


def _gradient_buffers_rank() -> list[int]:
    """Bytes of the gradient receive buffers alive as each backward starts (rank 0)."""
    torch.set_num_threads(1)
    layers = [LayerSpec(nn.Linear, 8, 8), nn.GELU(), LayerSpec(nn.Linear, 8, 8), nn.GELU()]
    engine = PipelineEngine(PipelineModule(layers, num_stages=2, loss_fn=F.mse_loss),
                            schedule="1f1b", num_microbatches=4, optimizer=sgd)
    made: list[tuple[weakref.ref[Any], int]] = []
    recv, interpreter = engine.comm.recv, engine._interpreter
    backward = interpreter.handlers[Kind.B]

    def counted_recv(message: Any, peer: int) -> Any:
        pending = recv(message, peer)
        made.extend((weakref.ref(b.untyped_storage()), b.untyped_storage().nbytes())
                    for b in pending.buffers)
        return pending

    alive: list[int] = []

    def counted_backward(op: Instruction) -> None:
        alive.append(sum(size for ref, size in made if ref() is not None))
        backward(op)

    engine.comm.recv = counted_recv  # type: ignore[method-assign]
    interpreter.handlers[Kind.B] = counted_backward
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):  # the second step runs on cached layouts
        engine.train_batch(torch.randn(8, 8, generator=generator),
                           torch.randn(8, 8, generator=generator))
    return alive


@pytest.mark.multiprocess
def test_one_gradient_buffer_during_a_backward_in_1f1b_cool_down() -> None:
    """Regression: rank 0 posted the last gradient's receive ahead of the backward before
    it, holding two gradient buffers with two microbatches in flight (the step's peak)."""
    alive = launch(_gradient_buffers_rank, 2, timeout=60)[0]
    message = 2 * 8 * 4  # a microbatch's gradient: 2 rows of 8 fp32
    # from 1F1B's definition: B(i) consumes gradient i, received for it alone
    assert alive == [message] * 8, alive
